// Package docs holds the user documentation (Markdown pages) and the
// tests that keep it true. It has no code.
//
// A page (README.md, or a .md file under docs/ outside testdata) that
// contains the line
//
//	<!-- runnable -->
//
// is runnable: TestRunnableDocs runs its fenced code blocks whose info
// string is exactly `sh`, in order, in one bash process per page
// (set -Eeuo pipefail), against the real stack. A block whose info string
// is `sh background` is started in the background and killed (SIGTERM to
// its process group) when the page ends; use it for the services
// (publisher run, indexer run). Blocks with any other info string
// (console, text, yaml, sql, …) are shown only, except `bash`, `shell`
// and `zsh`, which are errors on a runnable page (they look like commands
// but would not run); a runnable page without a `sh` block is an error
// too. The page runs with an environment of its own (nothing else of the
// test's: a stray TOPIC or OTEL_* in CI does not reach it):
//
//   - PATH, HOME, LANG, LC_ALL, TMPDIR, USER and TERM from the test's
//     environment, when set;
//   - DATABASE_URL: a new, empty database of its own (no migrations
//     applied: run `batcher migrate` as a user would); dropped afterwards;
//   - KAFKA_BROKERS and ELASTICSEARCH_URL: the shared stack;
//   - DOCS_RUN_ID: a name unique to this run of the page (lower case
//     letters, digits and '-'), for topics, indices, consumer groups and
//     job names that must not collide with other runs;
//   - METRICS_ADDR empty: no metrics listener (the default ports would
//     clash with other pages and tests running at once);
//   - batcher, publisher and indexer built from the tree as released (no
//     build tags) first on PATH;
//   - a new temporary working directory, in which every top-level entry of
//     the repository appears as a symbolic link (so `demo/job.yaml` and
//     `migrations/` resolve as in a clone); files the page writes land there;
//   - a time limit (runnablePageTimeout, 5 minutes); background blocks get
//     backgroundStopGrace (20 s) after SIGTERM before SIGKILL.
//
// Kafka and the search engine are shared with every other test and every
// earlier run, so a page names its topics, indices, aliases and consumer
// groups after DOCS_RUN_ID (`topic: ${DOCS_RUN_ID}.products` in its spec,
// `indexer run --topic … --alias ${DOCS_RUN_ID}-products --group
// ${DOCS_RUN_ID}`) rather than the defaults (outboxrelay.records, records),
// which other runs' documents also reach. In a SQL identifier use
// ${DOCS_RUN_ID//-/_}. After the page (its processes stopped), the
// Kafka topics whose names contain DOCS_RUN_ID (the indexer's .dlq ones
// too) and the indices and aliases matching *DOCS_RUN_ID* are deleted. A page waits for what a background service does
// with a bounded loop (for i in $(seq 60); do …; sleep 1; done) and then
// checks it; `exec` in a background block (echo "$BASHPID" > x.pid; exec
// publisher run) makes the service the process that gets the SIGTERM.
// docs/testdata/pipeline.md is a complete example.
//
// A command that fails fails the test, naming the page and the line.
//
// The `sh` blocks of the pages that are not runnable (README.md, most of
// docs/) are checked without running them by TestShownCommandsExist:
// every batcher, publisher or indexer command they show must exist with
// every flag it passes, and every UPPER_CASE variable they set must be a
// setting of one of the binaries (PATH and DOCS_RUN_ID aside), as the
// binaries declare them (their hidden __settings command, read with
// internal/settingsread as internal/cmd/docgen does).
// TestDocsLinks checks every relative link of every Markdown file of the
// repository: the file exists and, with #anchor, the heading exists
// (GitHub's anchors).
package docs
