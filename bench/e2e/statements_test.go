package bench_e2e

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PostgreSQL's share, by client. Each process connects as a role of its
// own (bench_batcher, bench_publisher, bench_indexer; the benchmark's own
// polling and reconcile stay the URL's user), so pg_stat_statements
// (preloaded by scripts/stack/postgres.sh) can tell whose statements
// PostgreSQL spent its time and its WAL on. The statements' execution
// time is not CPU time — it includes waits — but on a CPU-bound run it
// splits PostgreSQL's CPU between the clients; what no statement accounts
// for (autovacuum, the WAL writer, the checkpointer, connection start-up)
// is the rest.

// The roles of the three processes.
var clientRoles = map[string]string{"batcher": "bench_batcher", "publisher": "bench_publisher", "indexer": "bench_indexer"}

// prepareStatements creates the processes' roles, readies
// pg_stat_statements and empties it. ok is false (and why says why) when
// the server does not preload pg_stat_statements (E2E_BENCH_STACK=shared
// on a server started without it).
func prepareStatements(ctx context.Context, pool *pgxpool.Pool) (ok bool, why string, err error) {
	for _, role := range clientRoles {
		// SUPERUSER: the processes do what the URL's user may (create
		// triggers, read the catalog); only the name differs.
		if _, err := pool.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = %[1]s) THEN CREATE ROLE %[2]s LOGIN SUPERUSER; END IF;
END $$`, quoteLiteral(role), pgx.Identifier{role}.Sanitize())); err != nil {
			return false, "", fmt.Errorf("create role %s: %w", role, err)
		}
	}
	var preload string
	if err := pool.QueryRow(ctx, `SELECT current_setting('shared_preload_libraries')`).Scan(&preload); err != nil {
		return false, "", err
	}
	if !strings.Contains(preload, "pg_stat_statements") {
		return false, "the server does not preload pg_stat_statements (shared_preload_libraries = " + quoteLiteral(preload) + ")", nil
	}
	if _, err := pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return false, "", err
	}
	if _, err := pool.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
		return false, "", err
	}
	return true, "", nil
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// asRole returns env with DATABASE_URL's user replaced by role.
func asRole(env []string, role string) []string {
	out := slices.Clone(env)
	for i, kv := range out {
		raw, ok := strings.CutPrefix(kv, "DATABASE_URL=")
		if !ok {
			continue
		}
		u, err := url.Parse(raw)
		if err != nil {
			panic(fmt.Sprintf("DATABASE_URL %q: %v", raw, err))
		}
		if p, ok := u.User.Password(); ok {
			u.User = url.UserPassword(role, p)
		} else {
			u.User = url.User(role)
		}
		out[i] = "DATABASE_URL=" + u.String()
	}
	return out
}

// clientShare is what PostgreSQL spent on one client's statements in a run.
type clientShare struct {
	Client   string
	ExecTime time.Duration // total execution time of its statements
	Calls    int64
	WALBytes int64
	Top      []statementCost // its costliest statements, by time
}

type statementCost struct {
	Query    string
	Calls    int64
	ExecTime time.Duration
	WALBytes int64
}

// readStatements reads pg_stat_statements for the current database, by
// client (role).
func readStatements(ctx context.Context, pool *pgxpool.Pool) ([]clientShare, error) {
	rows, err := pool.Query(ctx, `
SELECT r.rolname, s.query, s.calls, s.total_exec_time, s.wal_bytes::bigint
  FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid
 WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY s.total_exec_time DESC`)
	if err != nil {
		return nil, err
	}
	byRole := map[string]*clientShare{}
	var order []string
	for rows.Next() {
		var role, query string
		var calls, wal int64
		var ms float64
		if err := rows.Scan(&role, &query, &calls, &ms, &wal); err != nil {
			return nil, err
		}
		client := "bench (polling, reconcile)"
		for name, r := range clientRoles {
			if r == role {
				client = name
			}
		}
		cs := byRole[client]
		if cs == nil {
			cs = &clientShare{Client: client}
			byRole[client] = cs
			order = append(order, client)
		}
		d := time.Duration(ms * float64(time.Millisecond))
		cs.ExecTime += d
		cs.Calls += calls
		cs.WALBytes += wal
		if len(cs.Top) < 4 {
			cs.Top = append(cs.Top, statementCost{Query: oneLine(query, 110), Calls: calls, ExecTime: d, WALBytes: wal})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	slices.Sort(order)
	out := make([]clientShare, 0, len(order))
	for _, c := range order {
		out = append(out, *byRole[c])
	}
	return out, nil
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		s = s[:n] + "…"
	}
	return s
}

// statementsTable splits PostgreSQL's CPU of a run between its clients,
// per 1,000 rows: a client's estimate is its statements' execution time,
// scaled down in proportion when the statements took longer than
// PostgreSQL's CPU in all (their time includes waits); the rest of the CPU
// is work no statement accounts for. With each client's WAL bytes per row
// and its costliest statements.
func statementsTable(name string, rows int, pgCPU time.Duration, shares []clientShare) string {
	var out strings.Builder
	var total time.Duration
	for _, c := range shares {
		total += c.ExecTime
	}
	scale := 1.0
	if total > pgCPU && total > 0 {
		scale = float64(pgCPU) / float64(total)
	}
	fmt.Fprintf(&out, "bench-e2e %s: PostgreSQL by client (pg_stat_statements), per 1,000 rows\n", name)
	fmt.Fprintf(&out, "%-28s %10s %12s %12s %10s\n", "client", "stmt_s", "cpu_s(est)", "calls", "wal_B/row")
	per := func(d time.Duration) float64 { return d.Seconds() / float64(rows) * 1000 }
	var est time.Duration
	for _, c := range shares {
		e := time.Duration(float64(c.ExecTime) * scale)
		est += e
		fmt.Fprintf(&out, "%-28s %10.4f %12.4f %12d %10.0f\n", c.Client, per(c.ExecTime), per(e), c.Calls, float64(c.WALBytes)/float64(rows))
	}
	fmt.Fprintf(&out, "%-28s %10s %12.4f\n", "no statement (background)", "", per(max(0, pgCPU-est)))
	fmt.Fprintf(&out, "%-28s %10s %12.4f\n", "postgres, all processes", "", per(pgCPU))
	for _, c := range shares {
		for _, s := range c.Top {
			fmt.Fprintf(&out, "  %-10s %8.1f s %9d calls %12.0f WAL B  %s\n", c.Client, s.ExecTime.Seconds(), s.Calls, float64(s.WALBytes), s.Query)
		}
	}
	return out.String()
}
