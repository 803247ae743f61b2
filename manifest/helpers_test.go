package manifest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/manifest"
	"github.com/outboxrelay/outboxrelay/outbox"
)

const testTenant = "alien-desserts"

// fixture is a database with the demo orders table: approved orders
// of testTenant, other pending orders of the same tenant that are not
// approved, and orders of another tenant, plus the manifest file for the
// approved ones.
type fixture struct {
	url      string
	pool     *pgxpool.Pool
	ids      []int64 // approved, ascending
	spec     map[string]any
	file     string
	jobID    string
	origRevs map[int64]int64
}

type fixtureOpts struct {
	ids       []int64
	chunkSize int
}

// nonContiguousIDs returns n ids with gaps: 3, 10, 17, ... (every
// third one is followed by a gap of 11).
func nonContiguousIDs(n int) []int64 {
	ids := make([]int64, n)
	next := int64(3)
	for i := range ids {
		ids[i] = next
		next += 7
		if i%3 == 2 {
			next += 11
		}
	}
	return ids
}

func contiguousIDs(n int) []int64 {
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = int64(i + 1)
	}
	return ids
}

func newFixture(t *testing.T, o fixtureOpts) *fixture {
	t.Helper()
	ctx := context.Background()
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	_, err := pool.Exec(ctx, manifest.DemoOrdersSQL)
	require.NoError(t, err)
	// Approved orders: revision 1..3 (varied), qty derived from the id.
	_, err = pool.Exec(ctx, `
INSERT INTO orders (id, tenant_id, revision, status, qty)
SELECT id, $2, 1 + id % 3, 'pending', 1 + id % 5 FROM unnest($1::bigint[]) AS id`, o.ids, testTenant)
	require.NoError(t, err)
	// Other tenants' pending orders and this tenant's unapproved ones, at ids
	// between and beyond the approved ones.
	_, err = pool.Exec(ctx, `
INSERT INTO orders (id, tenant_id, revision, status, qty)
SELECT g, CASE WHEN g % 2 = 0 THEN 'other-tenant' ELSE $2 END, 1, 'pending', 1 + g % 5
FROM generate_series(1, 1000) AS g
WHERE g <> ALL($1::bigint[])`, o.ids, testTenant)
	require.NoError(t, err)

	f := &fixture{url: url, pool: pool, ids: o.ids, jobID: "festival-cancel", origRevs: map[int64]int64{}}
	items := make([]map[string]any, len(o.ids))
	for i, id := range o.ids {
		f.origRevs[id] = 1 + id%3
		items[i] = map[string]any{"id": id, "revision": 1 + id%3, "fields": map[string]any{"qty": 1 + id%5}}
	}
	// The file lists the items out of order: registration sorts them.
	slices.Reverse(items)
	f.spec = map[string]any{
		"job_id": f.jobID, "tenant": testTenant,
		"target":     map[string]any{"table": "orders", "match_fields": []string{"qty"}},
		"transition": map[string]any{"from": "pending", "to": "cancelled"},
		"chunk_size": o.chunkSize,
		"items":      items,
	}
	f.file = f.writeFile(t, f.spec)
	return f
}

func (f *fixture) writeFile(t *testing.T, spec map[string]any) string {
	t.Helper()
	b, err := json.MarshalIndent(spec, "", " ")
	require.NoError(t, err)
	p := filepath.Join(t.TempDir(), "approved.json")
	require.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

func (f *fixture) parsed(t *testing.T) manifest.Spec {
	t.Helper()
	b, err := os.ReadFile(f.file)
	require.NoError(t, err)
	spec, err := manifest.Parse(bytes.NewReader(b))
	require.NoError(t, err)
	return spec
}

func (f *fixture) register(t *testing.T) {
	t.Helper()
	reg, err := manifest.Register(context.Background(), f.pool, f.parsed(t))
	require.NoError(t, err)
	require.True(t, reg.Created)
}

// dbSnapshot is everything a chunk may change, read over a new
// connection, so a test compares the database before and after.
type dbSnapshot struct {
	Orders    string
	Audit     string
	Outbox    string
	Job       string
	NextIndex int
	State     string
}

func (f *fixture) snapshot(t *testing.T) dbSnapshot {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, f.url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var s dbSnapshot
	require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(string_agg(format('%s/%s/%s/%s/%s', id, tenant_id, revision, status, qty), ',' ORDER BY id), '') FROM orders`).Scan(&s.Orders))
	require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(string_agg(format('%s/%s/%s/%s/%s', seq, item_id, before_revision, after_revision, fields), ',' ORDER BY seq), '') FROM manifest_audit`).Scan(&s.Audit))
	require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(string_agg(event_id::text, ',' ORDER BY event_id), '') FROM outbox_event_members`).Scan(&s.Outbox))
	require.NoError(t, conn.QueryRow(ctx, `SELECT format('%s/%s/%s/%s', next_index, state, conflict, chunks_done), next_index, state FROM manifest_jobs WHERE job_id = $1`, f.jobID).Scan(&s.Job, &s.NextIndex, &s.State))
	return s
}

// checkExactlyOnce checks over a new connection, independently of the
// code under test, that exactly the first n approved orders (in id order)
// changed once (pending → cancelled, revision + 1), each with one audit row
// and one outbox event, and that nothing else changed.
func (f *fixture) checkExactlyOnce(t *testing.T, n int) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, f.url)
	require.NoError(t, err)
	defer conn.Close(ctx)

	done := f.ids[:n]
	var changed []int64
	rows, err := conn.Query(ctx, `SELECT id FROM orders WHERE status = 'cancelled' ORDER BY id`)
	require.NoError(t, err)
	changed, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Equal(t, fmt.Sprint(done), fmt.Sprint(changed), "cancelled orders")

	// Revisions: approved and done = original + 1; everything else untouched.
	type row struct {
		ID       int64
		Revision int64
		Status   string
		Tenant   string
	}
	rows, err = conn.Query(ctx, `SELECT id, revision, status, tenant_id FROM orders ORDER BY id`)
	require.NoError(t, err)
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	isDone := map[int64]bool{}
	for _, id := range done {
		isDone[id] = true
	}
	for _, r := range all {
		want := int64(1)
		if rev, ok := f.origRevs[r.ID]; ok {
			want = rev
		}
		if isDone[r.ID] {
			want++
			require.Equal(t, testTenant, r.Tenant)
		} else {
			require.Equal(t, "pending", r.Status, "order %d", r.ID)
		}
		require.Equal(t, want, r.Revision, "order %d revision", r.ID)
	}

	// One audit row per done item, in list order, nothing else.
	rows, err = conn.Query(ctx, `SELECT item_id FROM manifest_audit WHERE job_id = $1 ORDER BY seq`, f.jobID)
	require.NoError(t, err)
	audited, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	wantIDs := make([]string, n)
	for i, id := range done {
		wantIDs[i] = strconv.FormatInt(id, 10)
	}
	require.Equal(t, wantIDs, audited, "audit")
	var dupAudit int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM (SELECT item_id FROM manifest_audit GROUP BY item_id HAVING count(*) > 1) d`).Scan(&dupAudit))
	require.Zero(t, dupAudit)

	// One outbox event per changed order, by its deterministic event id.
	wantEvents := make([]string, n)
	for i, id := range done {
		wantEvents[i] = outbox.EventID("manifest:"+f.jobID, strconv.FormatInt(id, 10), f.origRevs[id]+1, "manifest")
	}
	slices.Sort(wantEvents)
	rows, err = conn.Query(ctx, `SELECT event_id::text FROM outbox_event_members ORDER BY event_id`)
	require.NoError(t, err)
	events, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	if n == 0 {
		require.Empty(t, events)
	} else {
		require.Equal(t, wantEvents, events, "outbox event ids")
	}
	var badEvents int
	require.NoError(t, conn.QueryRow(ctx, `
SELECT count(*) FROM outbox_event_members e JOIN orders o ON o.id::text = e.aggregate_id
WHERE e.topic <> 'outboxrelay.orders' OR e.aggregate_type <> 'orders' OR e.aggregate_version <> o.revision
   OR e.event_type <> 'upsert' OR e.payload->>'status' <> 'cancelled' OR (e.payload->>'revision')::bigint <> o.revision`).Scan(&badEvents))
	require.Zero(t, badEvents, "events carry the new row and revision")

	var next int
	require.NoError(t, conn.QueryRow(ctx, `SELECT next_index FROM manifest_jobs WHERE job_id = $1`, f.jobID).Scan(&next))
	require.Equal(t, n, next, "next_index")
}
