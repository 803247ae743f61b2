package batch_test

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// TestReleaseBinaryHasNoFailpoints builds the binaries as the Dockerfile
// does and checks that they hold no failpoint, and that arming every batch
// failpoint in the environment of a release batcher changes nothing: the
// run neither dies nor retries, and the database ends exact.
func TestReleaseBinaryHasNoFailpoints(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"batcher", "publisher", "indexer"} {
		b, err := os.ReadFile(testproc.BuildRelease(t, name))
		require.NoError(t, err)
		require.False(t, bytes.Contains(bytes.ToLower(b), []byte("failpoint")), "%s holds the word failpoint", name)
		require.False(t, bytes.Contains(b, []byte(failpoint.EnvVar)), "%s reads %s", name, failpoint.EnvVar)
	}

	url, pool := newDB(t)
	seed(t, pool, 0, 1500, 1, 1)
	specFile := writeSpec(t, spec())
	armed := failpoint.EnvVar + "=batch.before_tx@1,batch.after_upsert@1,batch.chunk_error@1,batch.after_outbox@1,batch.after_checkpoint@1,batch.after_commit@1"
	p := testproc.Run(t, 2*time.Minute, testproc.BuildRelease(t, "batcher"), env(url, armed, crashLease), "run", "--spec", specFile)
	require.False(t, p.Killed(), p.Stderr())
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.NotContains(t, p.Stderr(), "failpoint")
	require.NotContains(t, p.Stderr(), "rolled back; retrying")
	exact(t, url, "records", 1500)
}
