package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/sink"
)

// The generation commands refuse, with exit 3 and a message that says
// why, what would lose searches or data; nothing changes then.
func TestGenerationCommandsRefuse(t *testing.T) {
	ctx := context.Background()
	dbURL := stack.Database(t)
	pool := stack.Pool(t, dbURL)
	esURL := stack.ElasticsearchURL(t)
	client, err := index.NewClient(esURL)
	require.NoError(t, err)
	alias, other := stack.UniqueName("gens"), stack.UniqueName("gens-other")
	t.Cleanup(func() {
		_, _ = client.DeleteIndex(alias+"_*", other+"_*").Do(context.Background())
	})
	// The live generation as the indexer creates it at its start: no
	// previous generation.
	live, err := index.Ensure(ctx, client, alias, alias+"-write", sink.DefaultMapping)
	require.NoError(t, err)
	// An index that only shares the alias's prefix (not made by the
	// indexer), and another alias's generation.
	foreign := alias + "_archive"
	_, err = client.CreateIndex(foreign).Do(ctx)
	require.NoError(t, err)
	otherGen := index.GenerationIndex(other, "v1")
	require.NoError(t, index.Create(ctx, client, otherGen, sink.DefaultMapping, nil))

	// Job j is at v2, whose generation no indexer has created yet.
	_, err = pool.Exec(ctx, `INSERT INTO batch_jobs (job, spec) VALUES ('j', '{"job":"j","processor_version":"v2","source_name":"src"}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO batch_runs (job, logical_run_id, state, processor_version, scope_hash, scope) VALUES ('j', 'r2', 'succeeded', 'v2', 'h', '{}')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO normalized_records (source, source_id, document, source_version, processor_version) VALUES ('src', '1', '{}', 1, 'v2')`)
	require.NoError(t, err)

	t.Setenv("DATABASE_URL", dbURL)
	t.Setenv("ELASTICSEARCH_URL", esURL)
	t.Setenv("ALIAS", alias)
	t.Setenv("WRITE_ALIAS", "")
	t.Setenv("ROUTES", "")
	tests := []struct {
		name string
		args []string
		want string
	}{
		{name: "cutover to a generation that does not exist", args: []string{"cutover", "--job", "j"},
			want: "index " + index.GenerationIndex(alias, "v2") + " does not exist yet (no indexer has seen an event of processor version v2)"},
		{name: "rollback without a previous generation", args: []string{"rollback", "--job", "j"},
			want: "generation " + live + ", where the documents of job j are live, records no previous generation to roll back to"},
		{name: "drop an index that does not exist", args: []string{"generations", "drop", "--index", alias + "_nothing"},
			want: alias + "_nothing is not a generation of alias " + alias},
		{name: "drop an index that is not a generation", args: []string{"generations", "drop", "--index", foreign},
			want: foreign + " is not a generation of alias " + alias},
		{name: "drop another alias's generation", args: []string{"generations", "drop", "--index", otherGen},
			want: otherGen + " is not a generation of alias " + alias},
		{name: "drop the live generation", args: []string{"generations", "drop", "--index", live},
			want: live + " is the live generation of alias " + alias},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := cli.Dispatch(ctx, "indexer", "test", commands(), tt.args, &stdout, &stderr)
			require.Equal(t, cli.ExitConflict, code, "stdout: %s\nstderr: %s", stdout.String(), stderr.String())
			require.Contains(t, stderr.String(), tt.want)
		})
	}
	read, err := index.AliasTargets(ctx, client, alias)
	require.NoError(t, err)
	require.Equal(t, []string{live}, read, "the read alias did not move")
	for _, index := range []string{live, foreign, otherGen} {
		exists, err := client.IndexExists(index).Do(ctx)
		require.NoError(t, err)
		require.True(t, exists, "%s is still there", index)
	}
}
