package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
)

const (
	// rrSeedEnv replays a TestRandomRelations history: the seed rows, the
	// writers' choices (operation, rows, values, pauses) and the kills'
	// schedule. The processes' timing still varies.
	rrSeedEnv = "E2E_RREL_SEED"
	// rrDurationEnv is how long the writers write (default rrDuration).
	rrDurationEnv = "E2E_RREL_DURATION"
	rrDuration    = 45 * time.Second
	// rrCatchUp: once the writers stop, every live post's document must
	// be in the index, equal to the model, within this long.
	rrCatchUp = 60 * time.Second
	// The rows before the history.
	rrAuthors  = 30
	rrTags     = 20
	rrPosts    = 400
	rrComments = 1200
	rrPostTags = 800
	rrJob      = "posts-rrel"
)

// rrSpec is the job: posts with their author (one_to_one object, through
// posts.author_id), their comments (one_to_many objects, soft-deleted ones
// left out, in position, id order) and their tags' names (one_to_many
// scalar through post_tags, in the default order: the tags' primary key).
// The foreign keys are given explicitly: the tables declare none, so a
// post can name an author or a tag that was deleted or does not exist yet,
// and a comment a post that is gone.
const rrSpec = `job: ` + rrJob + `
mode: incremental
source: {table: posts, cursor: [change_seq], id: id, version: version, deleted: deleted_at}
document:
  fields:
    - {name: id, from: id}
    - {name: title, from: title, transforms: [trim]}
  drop_nulls: false
  relations:
    - name: author
      table: authors
      type: one_to_one
      variant: object
      foreign_key: {parent: author_id, child: id}
      fields: [{name: id}, {name: name, transforms: [upper]}]
    - name: comments
      table: comments
      type: one_to_many
      foreign_key: {parent: id, child: post_id}
      deleted: deleted_at
      order_by: [position, id]
      fields: [{name: id}, {name: body, transforms: [trim]}, {name: position}]
    - name: tags
      table: tags
      type: one_to_many
      variant: scalar
      through: {table: post_tags, parent: post_id, child: tag_id}
      foreign_key: {parent: id, child: id}
      fields: [{name: name}]
processor_version: v1
topic: %s
vanished: delete
chunk: {size: 50, min: 20, max: 400}
errors: {policy: quarantine}
`

// rrSchema is the user's four tables and a join table. posts.version grows
// and posts.change_seq (a sequence with CACHE 1, the incremental cursor)
// is set again on every real update, as the demo's source_records.
const rrSchema = `
CREATE TABLE authors (id bigint PRIMARY KEY, name text NOT NULL);
CREATE TABLE tags (id bigint PRIMARY KEY, name text NOT NULL);
CREATE SEQUENCE posts_change_seq CACHE 1;
CREATE TABLE posts (
    id         bigint      PRIMARY KEY,
    title      text        NOT NULL,
    author_id  bigint,
    version    bigint      NOT NULL DEFAULT 1,
    change_seq bigint      NOT NULL DEFAULT nextval('posts_change_seq') UNIQUE,
    deleted_at timestamptz
);
CREATE INDEX posts_author_id ON posts (author_id);
CREATE FUNCTION posts_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW IS DISTINCT FROM OLD THEN
        NEW.version := OLD.version + 1;
        NEW.change_seq := nextval('posts_change_seq');
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER posts_bump BEFORE UPDATE ON posts FOR EACH ROW EXECUTE FUNCTION posts_bump();
CREATE TABLE comments (
    id         bigint      PRIMARY KEY,
    post_id    bigint      NOT NULL,
    body       text        NOT NULL,
    position   int         NOT NULL,
    deleted_at timestamptz
);
CREATE INDEX comments_post_id ON comments (post_id);
CREATE TABLE post_tags (post_id bigint NOT NULL, tag_id bigint NOT NULL, PRIMARY KEY (post_id, tag_id));
CREATE INDEX post_tags_tag_id ON post_tags (tag_id);
`

// rrSeedSQL fills the tables before the history; $1 mixes the seed into
// the choices. Some posts have no author, some an author id that does not
// exist (yet: author ids grow past rrAuthors in the history); some
// comments are soft-deleted; some post_tags name tags that do not exist
// yet.
var rrSeedSQL = []string{
	fmt.Sprintf(`INSERT INTO authors SELECT i, 'author ' || i FROM generate_series(1, %d) i`, rrAuthors),
	fmt.Sprintf(`INSERT INTO tags SELECT i, 'tag-' || i FROM generate_series(1, %d) i`, rrTags),
	fmt.Sprintf(`INSERT INTO posts (id, title, author_id)
SELECT i, ' post ' || i || ' ', CASE WHEN (i * 7 + $1) %% 11 <> 0 THEN 1 + (i * 13 + $1) %% %d END
FROM generate_series(1, %d) i`, rrAuthors+3, rrPosts),
	fmt.Sprintf(`INSERT INTO comments (id, post_id, body, position, deleted_at)
SELECT i, 1 + (i * 31 + $1) %% %d, ' comment ' || i, (i * 17 + $1) %% 10, CASE WHEN (i + $1) %% 9 = 0 THEN now() END
FROM generate_series(1, %d) i`, rrPosts, rrComments),
	fmt.Sprintf(`INSERT INTO post_tags SELECT DISTINCT 1 + (i * 29 + $1) %% %d, 1 + (i * 5 / 3 + $1) %% %d FROM generate_series(1, %d) i`, rrPosts, rrTags+3, rrPostTags),
}

// rrModelSQL is the model: for every live post (not soft-deleted; a
// hard-deleted one is no row), its id, version and the document the job
// must index, computed here from the source tables by hand, not by the
// product's compiler: the root's fields, the author as an object or null,
// the comments that are not soft-deleted in (position, id) order ([] when
// none), the names of its tags (through post_tags, dangling links left
// out) in tag id order.
const rrModelSQL = `
SELECT p.id::text AS id, p.version,
       jsonb_build_object(
         'id', p.id,
         'title', btrim(p.title),
         'author', (SELECT jsonb_build_object('id', a.id, 'name', upper(a.name)) FROM authors a WHERE a.id = p.author_id),
         'comments', coalesce((SELECT jsonb_agg(jsonb_build_object('id', c.id, 'body', btrim(c.body), 'position', c.position) ORDER BY c.position, c.id)
                               FROM comments c WHERE c.post_id = p.id AND c.deleted_at IS NULL), '[]'::jsonb),
         'tags', coalesce((SELECT jsonb_agg(t.name ORDER BY t.id) FROM post_tags pt JOIN tags t ON t.id = pt.tag_id WHERE pt.post_id = p.id), '[]'::jsonb)
       ) AS doc
FROM posts p
WHERE p.deleted_at IS NULL`

// TestRandomRelations is a randomized history against a relation job
// (posts with author, comments and tags; incremental, `batcher run
// --follow`, vanished: delete, the triggers of `follow-trigger --install`
// on every table), with the publisher and the indexer, each a real
// process under a supervisor that starts it again when it dies.
// Concurrent writers insert, update, soft- and hard-delete rows of every
// table: posts (title, author changed, soft-deleted, revived, deleted,
// a deleted id inserted again with its version from 1), comments (edited,
// reordered, moved to another post, soft-deleted, revived, deleted),
// authors (inserted, renamed, deleted, given another id), tags (inserted,
// renamed, deleted), post_tags (links added, removed, moved), in
// single statements, in transactions of several of them across tables,
// and in long transactions held open for seconds. Meanwhile the batcher
// is SIGKILLed every few seconds, and every second one started crashes
// on its own in the relation phase (a chunk of rebuilt documents and
// their events written, before or after its commit). Once the writers
// stop, with no manual run, within rrCatchUp: every live post's document
// in the index (read alias) equals the document computed by the test's
// own SQL over the source tables (rrModelSQL) at a version not below the
// post's, and no deleted post (soft or hard) is found; it still holds
// once the outbox and the topic are drained; and on the topic no (post,
// version) carries two different documents, and no post's version
// appears first after a newer one. The seed is printed (E2E_RREL_SEED
// replays the choices); E2E_RREL_DURATION sets the history's length.
func TestRandomRelations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	seed := testproc.Seed(t, rrSeedEnv)
	history := rrDuration
	if v := os.Getenv(rrDurationEnv); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, rrDurationEnv)
		history = d
	}

	p := newPipeline(t, pipelineOptions{TopicPartitions: 3})
	p.spec.Job = rrJob
	p.specFile = filepath.Join(t.TempDir(), "job.yaml")
	require.NoError(t, os.WriteFile(p.specFile, []byte(fmt.Sprintf(rrSpec, p.topic)), 0o644))
	rng := rand.New(rand.NewPCG(seed, 32))
	_, err := p.pool.Exec(ctx, rrSchema)
	require.NoError(t, err)
	mix := rng.IntN(1000)
	for _, q := range rrSeedSQL {
		var args []any
		if strings.Contains(q, "$1") {
			args = append(args, mix)
		}
		_, err = p.pool.Exec(ctx, q, args...)
		require.NoError(t, err, q)
	}
	tr := testproc.Run(t, time.Minute, p.batcherBin, p.env(), "follow-trigger", "--spec", p.specFile, "--install")
	require.Equal(t, 0, tr.ExitCode(), "follow-trigger --install:\n%s", tr.Stderr())

	h := &rrHistory{rfHistory: rfHistory{t: t, p: p, rng: rng}}
	h.next[rrPost].Store(rrPosts)
	h.next[rrComment].Store(rrComments)
	h.next[rrAuthor].Store(rrAuthors)
	h.next[rrTag].Store(rrTags)
	// During the history, every second follower started has a crash
	// point of the relation phase armed, the points in turn: it kills
	// itself on the phase's first chunk, once its documents and events
	// are written, before or after its commit (and the killer leaves it
	// to that).
	writeCtx, stopWriters := context.WithTimeout(ctx, history)
	defer stopWriters()
	var fpMu sync.Mutex
	var started int
	h.followerEnv = func() []string {
		fpMu.Lock()
		defer fpMu.Unlock()
		started++
		if writeCtx.Err() != nil || started%2 == 1 {
			return nil
		}
		return []string{"OUTBOXRELAY_FAILPOINT=" + rrFailpoints[(started/2-1)%len(rrFailpoints)]}
	}
	procCtx, stopProcs := context.WithCancel(ctx)
	defer stopProcs()
	for _, kind := range []string{"follower", "publisher", "indexer"} {
		h.supervise(procCtx, &rfSlot{kind: kind})
	}

	start := time.Now()
	var wg sync.WaitGroup
	const writers = 2
	for i := range writers {
		wg.Add(1)
		go func() { defer wg.Done(); h.write(writeCtx, h.fork(uint64(i))) }()
	}
	wg.Add(2)
	go func() { defer wg.Done(); h.longWriter(writeCtx, h.fork(100)) }()
	go func() { defer wg.Done(); h.killBatcher(writeCtx, h.fork(200)) }()
	wg.Wait()
	stopped := time.Now()
	h.requireNoWriterError()
	t.Logf("writers stopped after %s: %s; kills %v; %s", stopped.Sub(start).Round(time.Millisecond), h.opsSummary(), h.killCounts(), h.where(ctx))

	// The history must have happened for the test to mean anything: every
	// kind of change (counted only when it changed a row) and the kills.
	for _, op := range rrOps {
		require.Positivef(t, h.opCount(op), "%s operations in the history (%s)", op, h.opsSummary())
	}
	for _, op := range []string{"multi", "long"} {
		require.Positivef(t, h.opCount(op), "%s transactions in the history", op)
	}
	require.Positive(t, h.killCount("follower"), "SIGKILLs of the batcher")
	for _, fp := range rrFailpoints {
		require.Positivef(t, h.failpointCrashes(fp), "batcher crashes at %s", fp)
	}

	// No manual run: the follower (the last one the supervisor started),
	// the publisher and the indexer carry the rest within rrCatchUp. A
	// check that began within it and finds the index equal passes.
	deadline := stopped.Add(rrCatchUp)
	var c *rrCheck
	var matched time.Duration
	for {
		began := time.Since(stopped)
		c = h.check(ctx)
		if c.ok() {
			matched = began
			break
		}
		if !time.Now().Before(deadline) {
			require.FailNowf(t, "the index differs from the model", "seed %d, in the check that began %s after the writers stopped: %s\n%s",
				seed, began.Round(time.Millisecond), c, h.logs())
		}
		t.Logf("model: not yet equal in the check that began +%s: %s; %s", began.Round(time.Millisecond), c.summary(), h.where(ctx))
		pause(ctx, 500*time.Millisecond)
	}
	t.Logf("model: %s in the check that began +%s after the writers stopped", c.summary(), matched.Round(time.Millisecond))

	// And it stays so once the outbox and the topic are drained: no late
	// event (a replay, an older rebuild) brought back a deleted post or
	// an older document.
	h.waitDrained(ctx, time.Minute)
	c = h.check(ctx)
	require.Truef(t, c.ok(), "seed %d: the index differs from the model once drained: %s\n%s", seed, c, h.logs())
	records, problems := h.topicCheck(ctx)
	require.Emptyf(t, problems[:min(len(problems), oracleShown)], "seed %d: %d problems in the topic's %d records, the first ones shown", seed, len(problems), records)
	h.requireNoUnexpectedExit()
	crashes := map[string]int{}
	for _, fp := range rrFailpoints {
		crashes[fp] = h.failpointCrashes(fp)
	}
	stopProcs()
	h.procs.Wait()

	report(t, "seed %d, history %s: %s; SIGKILLs of the batcher %d, crashes at failpoints %v; %d restarts (%d follower exits after a lost lease); %d records on the topic",
		seed, history, h.opsSummary(), h.killCount("follower"), crashes, h.restarts.Load(), h.leaseLost.Load(), records)
	report(t, "writers stopped → index equal to the model by the check that began +%s (%d live posts, %d deleted posts not found); test %s",
		matched.Round(time.Millisecond), c.Live, c.Deleted, time.Since(start).Round(time.Millisecond))
}

// The tables whose ids the history allocates.
const (
	rrPost = iota
	rrComment
	rrAuthor
	rrTag
	rrTables
)

// rrOps are the kinds of single changes; each must have changed a row at
// least once in a history.
var rrOps = []string{
	"post-insert", "post-title", "post-author", "post-soft-delete", "post-revive", "post-delete",
	"comment-insert", "comment-edit", "comment-reorder", "comment-move", "comment-soft-delete", "comment-revive", "comment-delete",
	"author-insert", "author-rename", "author-delete",
	"tag-insert", "tag-rename", "tag-delete",
	"link-add", "link-remove",
	"post-reinsert", "author-rekey", "link-move", "authors-rename",
}

// rrHistory is the history's writers and kills; the supervised processes
// and the counters are random_follow_test.go's.
type rrHistory struct {
	rfHistory
	next [rrTables]atomic.Int64 // the last id allocated per table
}

func (h *rrHistory) newID(table int) int64 { return h.next[table].Add(1) }

// someID is an id of table at random among those allocated so far, and
// now and then one just past them (a row that does not exist yet).
func (h *rrHistory) someID(rng *rand.Rand, table int) int64 {
	return 1 + rng.Int64N(h.next[table].Load()+2)
}

// rrPickSQL is one existing row of table at or after the id param
// (matching cond), or, past the last one, the first such row.
func rrPickSQL(table, cond, param string) string {
	return `(SELECT id FROM (
  (SELECT id FROM ` + table + ` WHERE id >= ` + param + `::bigint AND ` + cond + ` ORDER BY id LIMIT 1)
  UNION ALL
  (SELECT id FROM ` + table + ` WHERE ` + cond + ` ORDER BY id LIMIT 1)) x LIMIT 1)`
}

// op makes one random change on db; it returns the operation's name and
// whether it changed a row (only those are counted, by the caller, once
// their transaction committed).
func (h *rrHistory) op(ctx context.Context, db rfDB, rng *rand.Rand, tag string) (string, bool, error) {
	text := fmt.Sprintf(" %s %d ", tag, rng.Uint32())
	exec := func(sql string, args ...any) (bool, error) {
		ct, err := db.Exec(ctx, sql, args...)
		return err == nil && ct.RowsAffected() > 0, err
	}
	at := func(table int) int64 { return 1 + rng.Int64N(h.next[table].Load()) }
	var op string
	var changed bool
	var err error
	switch n := rng.IntN(108); {
	// posts: 25%, comments 40%, authors 10%, tags 8%, post_tags 17%, and
	// 7% of changes of keys, and a rename of a quarter of the authors
	// (at the end)
	case n < 4:
		op = "post-insert"
		author := any(h.someID(rng, rrAuthor))
		if rng.IntN(8) == 0 {
			author = nil
		}
		changed, err = exec(`INSERT INTO posts (id, title, author_id) VALUES ($1, $2, $3)`, h.newID(rrPost), text, author)
	case n < 12:
		op = "post-title"
		changed, err = exec(`UPDATE posts SET title = $2 WHERE id = `+rrPickSQL("posts", "true", "$1"), at(rrPost), text)
	case n < 17:
		op = "post-author"
		author := any(h.someID(rng, rrAuthor))
		if rng.IntN(8) == 0 {
			author = nil
		}
		changed, err = exec(`UPDATE posts SET author_id = $2 WHERE id = `+rrPickSQL("posts", "true", "$1"), at(rrPost), author)
	case n < 20:
		op = "post-soft-delete"
		changed, err = exec(`UPDATE posts SET deleted_at = clock_timestamp() WHERE id = `+rrPickSQL("posts", "deleted_at IS NULL", "$1"), at(rrPost))
	case n < 22:
		op = "post-revive"
		changed, err = exec(`UPDATE posts SET deleted_at = NULL, title = $2 WHERE id = `+rrPickSQL("posts", "deleted_at IS NOT NULL", "$1"), at(rrPost), text)
	case n < 25:
		op = "post-delete"
		changed, err = exec(`DELETE FROM posts WHERE id = `+rrPickSQL("posts", "true", "$1"), at(rrPost))
	// comments: 40%
	case n < 33:
		op = "comment-insert"
		changed, err = exec(`INSERT INTO comments (id, post_id, body, position) VALUES ($1, $2, $3, $4)`,
			h.newID(rrComment), h.someID(rng, rrPost), text, rng.IntN(10))
	case n < 41:
		op = "comment-edit"
		changed, err = exec(`UPDATE comments SET body = $2 WHERE id = `+rrPickSQL("comments", "true", "$1"), at(rrComment), text)
	case n < 46:
		op = "comment-reorder"
		changed, err = exec(`UPDATE comments SET position = $2 WHERE id = `+rrPickSQL("comments", "true", "$1"), at(rrComment), rng.IntN(10))
	case n < 53:
		op = "comment-move"
		// To an existing post most of the time.
		changed, err = exec(`UPDATE comments SET post_id = x.post FROM (SELECT coalesce(`+rrPickSQL("posts", "true", "$2")+`, $2) AS post) x
WHERE comments.id = `+rrPickSQL("comments", "true", "$1")+` AND comments.post_id <> x.post`,
			at(rrComment), h.someID(rng, rrPost))
	case n < 58:
		op = "comment-soft-delete"
		changed, err = exec(`UPDATE comments SET deleted_at = clock_timestamp() WHERE id = `+rrPickSQL("comments", "deleted_at IS NULL", "$1"), at(rrComment))
	case n < 61:
		op = "comment-revive"
		changed, err = exec(`UPDATE comments SET deleted_at = NULL, body = $2 WHERE id = `+rrPickSQL("comments", "deleted_at IS NOT NULL", "$1"), at(rrComment), text)
	case n < 65:
		op = "comment-delete"
		changed, err = exec(`DELETE FROM comments WHERE id = `+rrPickSQL("comments", "true", "$1"), at(rrComment))
	// authors: 10%
	case n < 67:
		op = "author-insert"
		// Now and then an author a post already names.
		changed, err = exec(`INSERT INTO authors (id, name) VALUES ($1, $2)`, h.newID(rrAuthor), text)
	case n < 73:
		op = "author-rename"
		changed, err = exec(`UPDATE authors SET name = $2 WHERE id = `+rrPickSQL("authors", "true", "$1"), at(rrAuthor), text)
	case n < 75:
		op = "author-delete"
		changed, err = exec(`DELETE FROM authors WHERE id = `+rrPickSQL("authors", "true", "$1"), at(rrAuthor))
	// tags: 8%
	case n < 77:
		op = "tag-insert"
		changed, err = exec(`INSERT INTO tags (id, name) VALUES ($1, $2)`, h.newID(rrTag), text)
	case n < 82:
		op = "tag-rename"
		changed, err = exec(`UPDATE tags SET name = $2 WHERE id = `+rrPickSQL("tags", "true", "$1"), at(rrTag), text)
	case n < 83:
		op = "tag-delete"
		changed, err = exec(`DELETE FROM tags WHERE id = `+rrPickSQL("tags", "true", "$1"), at(rrTag))
	// post_tags: 17%
	case n < 92:
		op = "link-add"
		changed, err = exec(`INSERT INTO post_tags (post_id, tag_id) SELECT post, $2 FROM (SELECT `+rrPickSQL("posts", "true", "$1")+` AS post) x
WHERE post IS NOT NULL ON CONFLICT DO NOTHING`,
			at(rrPost), h.someID(rng, rrTag))
	case n < 100:
		op = "link-remove"
		changed, err = exec(`DELETE FROM post_tags WHERE (post_id, tag_id) = (SELECT post_id, tag_id FROM post_tags WHERE post_id >= $1 ORDER BY post_id, tag_id LIMIT 1)`,
			at(rrPost))
	// keys
	case n < 102:
		op = "post-reinsert"
		// A hard-deleted post's id again, its version from 1 again (below
		// its tombstone's); its orphaned comments and links are its own
		// again.
		changed, err = exec(`INSERT INTO posts (id, title, author_id)
SELECT g, $2, $3 FROM generate_series($1::bigint, $1::bigint + 100) g
WHERE g <= $4 AND NOT EXISTS (SELECT FROM posts WHERE id = g) LIMIT 1
ON CONFLICT DO NOTHING`, at(rrPost), text, h.someID(rng, rrAuthor), h.next[rrPost].Load())
	case n < 104:
		op = "author-rekey"
		// The posts that named the old id lose their author, those that
		// named the new one (not yet existing) get it.
		changed, err = exec(`UPDATE authors SET id = $2 WHERE id = `+rrPickSQL("authors", "true", "$1"), at(rrAuthor), h.newID(rrAuthor))
	case n < 107:
		op = "link-move"
		// A link moved to another post (skipped when that post has it).
		changed, err = exec(`UPDATE post_tags l SET post_id = x.post
FROM (SELECT `+rrPickSQL("posts", "true", "$2")+` AS post) x
WHERE (l.post_id, l.tag_id) = (SELECT post_id, tag_id FROM post_tags WHERE post_id >= $1 ORDER BY post_id, tag_id LIMIT 1)
  AND x.post IS NOT NULL AND NOT EXISTS (SELECT FROM post_tags o WHERE o.post_id = x.post AND o.tag_id = l.tag_id)`,
			at(rrPost), at(rrPost))
	default: // one change in 432
		op = "authors-rename"
		// Shared parents: about a quarter of the posts to rebuild, in
		// several chunks of the relation phase.
		if rng.IntN(4) == 0 {
			changed, err = exec(`UPDATE authors SET name = $2 || id WHERE id % 4 = $1 % 4`, at(rrAuthor), text)
		}
	}
	if err != nil {
		return op, false, fmt.Errorf("%s: %w", op, err)
	}
	return op, changed, nil
}

// tx makes n random changes in one transaction (n = 1: a single
// statement on the pool) and counts them once committed; hold keeps the
// transaction open that long before its commit (the writer's workload,
// not a synchronization).
func (h *rrHistory) tx(ctx context.Context, rng *rand.Rand, tag string, n int, hold time.Duration) error {
	if n == 1 && hold == 0 {
		op, changed, err := h.op(ctx, h.p.pool, rng, tag)
		if err == nil && changed {
			h.count(&h.ops, op)
		}
		return err
	}
	// The commit is not cut short by the history's end.
	ctx = context.WithoutCancel(ctx)
	tx, err := h.p.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var done []string
	for range n {
		op, changed, err := h.op(ctx, tx, rng, tag)
		if err != nil {
			return err
		}
		if changed {
			done = append(done, op)
		}
	}
	if hold > 0 {
		t := time.NewTimer(hold)
		<-t.C
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	for _, op := range done {
		h.count(&h.ops, op)
	}
	return nil
}

// write makes changes every 10–60 ms until ctx ends: one statement, or
// one time in five a transaction of two to four across the tables.
func (h *rrHistory) write(ctx context.Context, rng *rand.Rand) {
	for ctx.Err() == nil {
		pause(ctx, time.Duration(10+rng.IntN(50))*time.Millisecond)
		if ctx.Err() != nil {
			return
		}
		n := 1
		if rng.IntN(5) == 0 {
			n = 2 + rng.IntN(3)
		}
		err := h.tx(ctx, rng, "w", n, 0)
		if err == nil && n > 1 {
			h.count(&h.ops, "multi")
		}
		if err != nil && !rrRetryable(err) {
			h.fail(ctx, err)
			return
		}
	}
}

// rrRetryable: a deadlock between writers, or two of them moving links
// onto one post at once (a unique violation), is the writers' business,
// not the product's.
func rrRetryable(err error) bool {
	var pe *pgconn.PgError
	return rfRetryable(err) || errors.As(err, &pe) && pe.Code == "23505"
}

// longWriter, every 1–3 s: a transaction of one to three changes held
// open for 1–4 s (longer than a chunk of the batcher, some longer than
// OPEN_WRITERS_WAIT) before its commit.
func (h *rrHistory) longWriter(ctx context.Context, rng *rand.Rand) {
	for ctx.Err() == nil {
		pause(ctx, time.Duration(1000+rng.IntN(2000))*time.Millisecond)
		if ctx.Err() != nil {
			return
		}
		err := h.tx(ctx, rng, "long", 1+rng.IntN(3), time.Duration(1000+rng.IntN(3000))*time.Millisecond)
		if err == nil {
			h.count(&h.ops, "long")
		}
		if err != nil && !rrRetryable(err) {
			h.fail(ctx, err)
			return
		}
	}
}

// killBatcher SIGKILLs the follower every 4–7 s until ctx ends, unless
// it is one with a failpoint armed (it is left to crash there); its
// supervisor starts it again.
func (h *rrHistory) killBatcher(ctx context.Context, rng *rand.Rand) {
	for ctx.Err() == nil {
		pause(ctx, time.Duration(4000+rng.IntN(3000))*time.Millisecond)
		if ctx.Err() != nil {
			return
		}
		h.mu.Lock()
		var s *rfSlot
		for _, slot := range h.slots {
			if slot.kind == "follower" {
				s = slot
			}
		}
		h.mu.Unlock()
		pr := s.current()
		if pr == nil || slices.ContainsFunc(pr.Cmd.Env, func(kv string) bool { return strings.HasPrefix(kv, "OUTBOXRELAY_FAILPOINT=") }) {
			continue
		}
		if pr.Signal(syscall.SIGKILL) == nil {
			h.count(&h.kills, s.kind)
		}
	}
}

// rrCheck is what a check of the index against the model found.
type rrCheck struct {
	Live    int64 // live posts in the model
	Deleted int64 // post ids allocated that are not live (soft- or hard-deleted)
	byKind  map[string]int
	diffs   []string
}

func (c *rrCheck) ok() bool { return len(c.byKind) == 0 }

func (c *rrCheck) summary() string {
	if c.ok() {
		return fmt.Sprintf("%d live posts equal to the model, none of %d deleted ones found", c.Live, c.Deleted)
	}
	kinds := make([]string, 0, len(c.byKind))
	for k, n := range c.byKind {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
	}
	sort.Strings(kinds)
	return fmt.Sprintf("differences: %s (of %d live posts, %d deleted)", strings.Join(kinds, ", "), c.Live, c.Deleted)
}

func (c *rrCheck) String() string {
	if c.ok() {
		return c.summary()
	}
	return c.summary() + "; the first ones:\n  " + strings.Join(c.diffs, "\n  ")
}

// rrCompareSQL compares the pages the check scrolled (table rrel_pages:
// the read alias's hits, and the write alias's tombstones) with the model:
// each differing post id with its kind, the versions, and the document's
// keys whose values differ on each side (the whole document when one side
// has none). Kinds: missing (a live post with no visible document),
// content (its document differs from the model), version (its document's
// version is below the post's), soft-deleted-visible, deleted-visible (a
// visible document for a post soft-deleted or gone), unknown-visible (for
// an id never allocated), hidden (a document behind the write alias that
// is neither visible nor a tombstone: counted, not listed).
const rrCompareSQL = `
WITH e AS MATERIALIZED (` + rrModelSQL + `),
a AS MATERIALIZED (
  SELECT h->>'_id' AS id, (h->>'_version')::bigint AS version,
         (h->'_source') - '_bucket'::text - '_idv'::text - '_pv'::text - '_aggregate_type'::text AS doc
  FROM rrel_pages p, jsonb_array_elements(p.page::jsonb #> '{hits,hits}') h
  WHERE NOT p.tombstone
),
d AS (
  SELECT coalesce(e.id, a.id) AS id,
         CASE WHEN a.id IS NULL THEN 'missing'
              WHEN e.id IS NULL THEN (SELECT CASE WHEN s.deleted_at IS NOT NULL THEN 'soft-deleted-visible' END
                                      FROM posts s WHERE s.id::text = a.id)
              WHEN e.doc IS DISTINCT FROM a.doc THEN 'content'
              ELSE 'version'
         END AS kind,
         e.version AS want_version, a.version AS got_version, e.doc AS want, a.doc AS got
  FROM e FULL JOIN a ON a.id = e.id
  WHERE a.id IS NULL OR e.id IS NULL OR e.doc IS DISTINCT FROM a.doc OR a.version < e.version
)
SELECT (SELECT count(*) FROM e),
       (SELECT count(*) FROM rrel_pages p, jsonb_array_elements(p.page::jsonb #> '{hits,hits}') h WHERE p.tombstone),
       d.id, CASE WHEN d.kind IS NOT NULL THEN d.kind WHEN d.id::bigint <= $1 THEN 'deleted-visible' ELSE 'unknown-visible' END,
       coalesce(want_version, 0), coalesce(got_version, 0),
       coalesce(CASE WHEN want IS NULL OR got IS NULL THEN want
                     ELSE (SELECT jsonb_object_agg(k, v) FROM jsonb_each(want) w(k, v) WHERE got->k IS DISTINCT FROM v) END::text, '-'),
       coalesce(CASE WHEN want IS NULL OR got IS NULL THEN got
                     ELSE (SELECT jsonb_object_agg(k, v) FROM jsonb_each(got) g(k, v) WHERE want->k IS DISTINCT FROM v) END::text, '-')
FROM d RIGHT JOIN (SELECT) one ON true
ORDER BY d.id::bigint`

// check reads the index over the oracle's plain HTTP client (every
// document visible through the read alias, and the tombstones behind the
// write alias) and compares it with the model over a new connection.
func (h *rrHistory) check(ctx context.Context) *rrCheck {
	p := h.p
	t := h.t
	t.Helper()
	es := &searchHTTP{urls: p.searchURLs}
	_, err := es.do(ctx, http.MethodPost, "/"+p.alias+","+p.alias+"-write/_refresh", nil)
	require.NoError(t, err)
	conn, err := p.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `DROP TABLE IF EXISTS rrel_pages; CREATE TEMP TABLE rrel_pages (tombstone boolean NOT NULL, page text NOT NULL)`)
	require.NoError(t, err)
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), `DROP TABLE IF EXISTS rrel_pages`) }()
	store := func(tombstone bool) func(page []byte) error {
		return func(page []byte) error {
			_, err := conn.Exec(ctx, `INSERT INTO rrel_pages VALUES ($1, $2)`, tombstone, string(page))
			return err
		}
	}
	require.NoError(t, es.scroll(ctx, p.alias, nil, store(false)))
	require.NoError(t, es.scroll(ctx, p.alias+"-write", map[string]any{"term": map[string]any{"_deleted": true}}, store(true)))

	c := &rrCheck{byKind: map[string]int{}}
	var tombstones int64
	var id, kind *string
	var wantV, gotV int64
	var want, got string
	allocated := h.next[rrPost].Load()
	rows, err := conn.Query(ctx, rrCompareSQL, allocated)
	require.NoError(t, err)
	_, err = pgx.ForEachRow(rows, []any{&c.Live, &tombstones, &id, &kind, &wantV, &gotV, &want, &got}, func() error {
		if id == nil {
			return nil // no difference: the counts only
		}
		c.byKind[*kind]++
		if len(c.diffs) < oracleShown {
			c.diffs = append(c.diffs, fmt.Sprintf("%s post %s: version want ≥%d got %d (0: none), keys that differ:\n      want %s\n      got  %s",
				*kind, *id, wantV, gotV, clip(want, 1500), clip(got, 1500)))
		}
		return nil
	})
	require.NoError(t, err)
	c.Deleted = allocated - c.Live

	// Nothing hidden: every document behind the write alias is visible or
	// a tombstone.
	var visible int64
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM rrel_pages p, jsonb_array_elements(p.page::jsonb #> '{hits,hits}') h WHERE NOT p.tombstone`).Scan(&visible))
	b, err := es.do(ctx, http.MethodGet, "/"+p.alias+"-write/_count", nil)
	require.NoError(t, err)
	var count struct{ Count int64 }
	require.NoError(t, json.Unmarshal(b, &count))
	if hidden := count.Count - visible - tombstones; hidden != 0 {
		c.byKind["hidden"] += int(hidden)
		c.diffs = append(c.diffs, fmt.Sprintf("%d documents behind the write alias neither visible nor tombstones", hidden))
	}
	return c
}

// rrFailpoints are the relation phase's crash points (batch/rebuild.go).
var rrFailpoints = []string{"batch.relations_after_upsert", "batch.relations_after_commit"}

// failpointCrashes counts the followers that killed themselves at fp.
func (h *rrHistory) failpointCrashes(fp string) int {
	n := 0
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.slots {
		if s.kind != "follower" {
			continue
		}
		s.mu.Lock()
		for _, pr := range s.all {
			n += strings.Count(pr.Stderr(), "failpoint "+fp+": killing process")
		}
		s.mu.Unlock()
	}
	return n
}

// topicCheck reads every record on the topic and returns their number and
// what breaks the versioning the index relies on: two records of one
// event id (the post and its version: outboxrelay_event_id) with
// different payloads, i.e. a document that changed without a new version
// (the index keeps the first it got), and, per post, a version first seen
// after a newer one.
func (h *rrHistory) topicCheck(ctx context.Context) (records int, problems []string) {
	p, t := h.p, h.t
	t.Helper()
	st, err := p.status(ctx)
	require.NoError(t, err)
	type event struct {
		sum   [32]byte
		value string
	}
	byID := map[string]event{}
	seen := map[string]map[int64]bool{}
	last := map[string]int64{}
	problem := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	for _, part := range st.Partitions {
		if part.End <= part.First {
			continue
		}
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: p.brokers, Topic: p.topic, Partition: part.Partition, MaxWait: 250 * time.Millisecond, MaxBytes: 16 << 20})
		require.NoError(t, r.SetOffset(part.First))
		for next := part.First; next < part.End; {
			rctx, cancel := context.WithTimeout(ctx, time.Minute)
			m, err := r.ReadMessage(rctx)
			cancel()
			require.NoError(t, err, "read %s/%d at %d", p.topic, part.Partition, next)
			next = m.Offset + 1
			records++
			var id string
			var v int64
			for _, hd := range m.Headers {
				switch hd.Key {
				case outbox.HeaderID:
					id = string(hd.Value)
				case outbox.HeaderAggregateVersion:
					v, _ = strconv.ParseInt(string(hd.Value), 10, 64)
				}
			}
			key := string(m.Key)
			ev := event{sum: sha256.Sum256(m.Value), value: string(m.Value)}
			if prev, ok := byID[id]; !ok {
				byID[id] = ev
			} else if prev.sum != ev.sum {
				problem("post %s version %d (event %s) published with two documents:\n      %s\n      %s", key, v, id, clip(prev.value, 800), clip(ev.value, 800))
			}
			if v < last[key] && !seen[key][v] {
				problem("post %s: version %d first seen after version %d (partition %d offset %d)", key, v, last[key], part.Partition, m.Offset)
			}
			if seen[key] == nil {
				seen[key] = map[int64]bool{}
			}
			seen[key][v] = true
			last[key] = max(last[key], v)
		}
		require.NoError(t, r.Close())
	}
	return records, problems
}
