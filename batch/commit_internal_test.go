package batch

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// committed decides, after a COMMIT whose reply was lost, whether the
// chunk committed. Its successor (pipelined, waiting on the checkpoint row)
// may have committed meanwhile: the checkpoint then holds the successor's
// end, not this chunk's, and the successor's checkpoint UPDATE matched
// only because this chunk had committed. Reading that as "not committed"
// ran the chunk again, whose checkpoint UPDATE then matched no row, and
// the partition failed with ErrCheckpointInvariant although every row was
// written once. The chunk committed unless the checkpoint is still where
// it started.
func TestLostCommitIsCommittedWhenTheCheckpointMovedOn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newWaitSetup(t)
	f := &flight{slot: &connSlot{pool: s.pool}, prev: s.cl.cursor}
	defer f.slot.release()
	ts := "2026-12-05T00:00:00Z"
	own, next := []string{ts, "4"}, []string{ts, "8"}
	setCursor := func(c []string) {
		t.Helper()
		_, err := s.pool.Exec(ctx, `UPDATE batch_runs SET cursor = $2 WHERE job = $1`, s.r.spec.Job, c)
		require.NoError(t, err)
	}
	for _, tc := range []struct {
		name   string
		cursor []string
		want   bool
	}{
		{"the COMMIT did not get through", s.cl.cursor, false},
		{"the chunk's own end", own, true},
		{"a successor's end", next, true},
	} {
		setCursor(tc.cursor)
		got, err := s.r.committed(ctx, f, s.cl)
		require.NoError(t, err, tc.name)
		require.Equal(t, tc.want, got, tc.name)
	}
	// The lease is not held any more: not this worker's to say.
	_, err := s.pool.Exec(ctx, `UPDATE batch_runs SET lease_token = gen_random_uuid() WHERE job = $1`, s.r.spec.Job)
	require.NoError(t, err)
	got, err := s.r.committed(ctx, f, s.cl)
	require.NoError(t, err)
	require.False(t, got)
}
