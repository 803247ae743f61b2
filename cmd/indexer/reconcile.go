package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/esconn"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

func reconcileCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "reconcile",
		Summary: "compare normalized_records with the index per id bucket; --repair re-enqueues drifted ids",
		Run: func(ctx context.Context, args []string) error {
			var (
				common      cli.Common
				url, alias  string
				writeAlias  string
				source, job string
				idFormat    string
				topic       string
				routesFlag  string
				repair      bool
				force       bool
				full        bool
				sourceTable bool
				asJSON      bool
				limit, show int
				es          esconn.Settings
			)
			fs := cli.NewFlagSet("indexer reconcile", "Summarises both sides per id bucket (count and a hash of id, version, deleted, processor version), reads id by id\nonly the buckets that differ, and reports missing, stale and extra documents. Run it when the\npipeline is drained: events in flight show up as drift. Exit code 4 when drift is found and not\nrepaired.\n\nWith --job J --source-table it compares the index with the job's source table itself (its\nstored spec: table, id, version, soft-delete column, filter, partition list) instead of\nnormalized_records, per id bucket the same way, and reports documents live in the index whose\nsource row is gone (hard-deleted) or out of the job's scope, the key finding in incremental\nor vanished: keep jobs, which no run sweeps; and rows in scope missing from the index or at an\nolder version there (a run of the job carries those). --repair then deletes the gone\ndocuments through the pipeline: a tombstone in normalized_records above the document's\nversion and a delete event in the outbox, as the sweep of a full run writes them. Exit 4 when\ndrift is found and not repaired (missing or behind rows are never repaired by this mode).")
			common.RegisterDatabase(fs)
			common.RegisterLogging(fs)
			fs.SecretOrFile(&url, "elasticsearch-url", "ELASTICSEARCH_URL", "search engine URL, e.g. http://127.0.0.1:9200, or several nodes' URLs comma-separated (required)")
			es.Register(fs)
			fs.String(&alias, "alias", "ALIAS", sink.DefaultAlias, "read alias of the index")
			fs.String(&writeAlias, "write-alias", "WRITE_ALIAS", "", `unfiltered alias compared (tombstones included) ("" = <alias>-write)`)
			fs.String(&routesFlag, "routes", "ROUTES", "", `as for indexer run: with --job, the job's aggregate type picks its alias`)
			fs.String(&job, "job", "JOB", "", "scan job to compare: its source, processor version and that version's index generation come from its stored spec")
			fs.String(&source, "source", "RECONCILE_SOURCE", "", `without --job: normalized_records.source to compare against the write alias ("" = the only source in normalized_records, or the one whose aggregate type the index holds)`)
			fs.String(&topic, "topic", "TOPIC", sink.DefaultTopic, "topic of the repair events")
			fs.String(&idFormat, "id-format", "ID_FORMAT", sink.IDFormatID, `the indexer's ID_FORMAT; only "id" can be reconciled`)
			fs.Bool(&repair, "repair", "", false, "re-enqueue outbox events for missing and stale ids and delete extra documents (only the source's own, never tombstones, only as compared)")
			fs.Bool(&force, "force", "", false, fmt.Sprintf("let --repair delete more than %d documents and %g%% of those compared", reconcile.MaxRemoveFloor, reconcile.MaxRemoveShare*100))
			fs.Bool(&sourceTable, "source-table", "", false, "with --job: compare the index with the job's source table (finds documents whose source row is gone or out of scope); --repair deletes those through the outbox")
			fs.Bool(&full, "full", "", false, "compare every document's real _version (reads both sides whole; finds partial updates made by hand)")
			fs.Bool(&asJSON, "json", "", false, "print the report as JSON")
			fs.Int(&limit, "limit", "", 10_000, "most drifted ids listed (and repaired) per kind in one pass")
			fs.Int(&show, "show", "", 20, "drifted ids printed per kind in the table")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if url == "" {
				return cli.UsageError("ELASTICSEARCH_URL is required (e.g. http://127.0.0.1:9200)")
			}
			if sourceTable && job == "" {
				return cli.UsageError("--source-table needs --job: the job's stored spec says which table, columns and scope to compare")
			}
			if idFormat != sink.IDFormatID {
				// Every _id would differ from its source_id: all "missing"
				// and all "extra", and --repair would delete the index.
				return cli.UsageError("ID_FORMAT=%s: reconcile compares normalized_records ids with _id and needs ID_FORMAT=%s", idFormat, sink.IDFormatID)
			}
			pool, err := common.OpenDB(ctx, 4)
			if err != nil {
				return err
			}
			defer pool.Close()
			conn, err := es.Build(url)
			if err != nil {
				return err
			}
			logger, err := common.Logger()
			if err != nil {
				return err
			}
			if err := conn.Probe(ctx, logger); err != nil { // logs the unsafe settings too
				return err
			}
			client, err := index.NewClientWith(conn.URL, conn.HTTP)
			if err != nil {
				return cli.UsageError("ELASTICSEARCH_URL: %v", err)
			}
			cfg := reconcile.Config{
				DB: pool, Search: client, Index: cmp.Or(writeAlias, alias+"-write"),
				Source: source, Topic: topic, Limit: limit, Full: full, Force: force,
			}
			if job != "" {
				j, err := reconcile.LoadJob(ctx, pool, job)
				if err != nil {
					return conflictIfUnsafe(err)
				}
				// The generation searches read: the job's live processor
				// version, not the one its last run used (a rebuild).
				if j.ProcessorVersion, err = reconcile.LiveProcessorVersion(ctx, pool, j); err != nil {
					return err
				}
				cfg.Source, cfg.ProcessorVersion, cfg.AggregateType = j.SourceName, j.ProcessorVersion, j.AggregateType
				cfg.Topic = cmp.Or(j.Topic, topic)
				routes, err := sink.ParseRoutes(routesFlag)
				if err != nil {
					return cli.UsageError("%v", err)
				}
				routed := sink.Config{Alias: alias, Routes: routes}.ForAggregateType(j.AggregateType)
				if cfg.Index, err = index.GenerationTarget(ctx, client, routed.Alias, j.ProcessorVersion); err != nil {
					return err
				}
				if ok, err := indexExists(ctx, client, cfg.Index); err != nil {
					return err
				} else if !ok {
					return &cli.ExitError{Code: cli.ExitConflict, Err: fmt.Errorf("job %s is at processor version %s, whose index generation %s does not exist yet (no indexer has seen its events)", job, j.ProcessorVersion, cfg.Index)}
				}
			} else if gens, err := index.Generations(ctx, client, alias, cfg.Index); err == nil {
				// The live generation's processor version is the expected one.
				for _, g := range gens {
					if g.Writes {
						cfg.ProcessorVersion = g.Meta.ProcessorVersion
					}
				}
			}
			if sourceTable {
				return reconcileSourceTable(ctx, stdout, pool, cfg, job, repair, asJSON, show)
			}
			rep, err := reconcile.Run(ctx, cfg)
			if errors.Is(err, reconcile.ErrSource) {
				return cli.UsageError("--source: %v", err)
			}
			if err != nil {
				return err
			}
			var fixed *reconcile.RepairResult
			if repair && !rep.Clean() {
				res, err := reconcile.Repair(ctx, cfg, rep)
				if errors.Is(err, reconcile.ErrRepairTooLarge) {
					printReport(stdout, rep, nil, show)
					return cli.UsageError("%v (--force)", err)
				}
				if err != nil {
					return err
				}
				fixed = &res
			}
			if asJSON {
				if err := cli.WriteJSON(stdout, struct {
					reconcile.Report
					Repair *reconcile.RepairResult `json:"repair,omitempty"`
				}{rep, fixed}); err != nil {
					return err
				}
			} else {
				printReport(stdout, rep, fixed, show)
			}
			if !rep.Clean() && fixed == nil {
				return &cli.ExitError{Code: cli.ExitDrift, Err: fmt.Errorf("drift: %d missing, %d stale, %d extra (run with --repair to fix)", rep.MissingCount, rep.StaleCount, rep.ExtraCount)}
			}
			return nil
		},
	}
}

func printReport(w io.Writer, rep reconcile.Report, fixed *reconcile.RepairResult, show int) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "source\t%s\t(aggregate type %s)\n", rep.Source, rep.AggregateType)
	fmt.Fprintf(tw, "source rows\t%d\n", rep.SourceRows)
	fmt.Fprintf(tw, "index documents\t%d\t(of this aggregate type or none; tombstones included)\n", rep.IndexDocs)
	fmt.Fprintf(tw, "buckets differing\t%d of %d\n", len(rep.DifferingBuckets), sink.Buckets)
	fmt.Fprintf(tw, "documents read\t%d\t(only in differing buckets)\n", rep.DocsRead)
	fmt.Fprintf(tw, "missing\t%d\n", rep.MissingCount)
	fmt.Fprintf(tw, "stale\t%d\n", rep.StaleCount)
	fmt.Fprintf(tw, "extra\t%d\n", rep.ExtraCount)
	if rep.SourceRowsOtherPV > 0 {
		fmt.Fprintf(tw, "rows of another processor version\t%d\t(in normalized_records: not rebuilt by the batcher yet)\n", rep.SourceRowsOtherPV)
	}
	fmt.Fprintf(tw, "took\t%s\n", rep.Took.Round(1e6))
	tw.Flush()
	list := func(kind string, ds []reconcile.Drift) {
		listDrifts(w, kind, "ID\tSOURCE VERSION\tSOURCE DELETED\tSOURCE PV\tINDEX VERSION\tINDEX DELETED\tINDEX PV", ds, show, func(d reconcile.Drift) string {
			return fmt.Sprintf("%s\t%s\t%v\t%s\t%s\t%v\t%s", d.ID, orDash(d.SourceVersion), d.SourceDeleted, cmp.Or(d.SourcePV, "-"),
				orDash(d.IndexVersion), d.IndexDeleted, cmp.Or(d.IndexPV, "-"))
		})
	}
	list("missing (in normalized_records, not in the index)", rep.Missing)
	list("stale (another version, deleted-ness or processor version in the index)", rep.Stale)
	list("extra (in the index, not in normalized_records)", rep.Extra)
	if fixed != nil {
		fmt.Fprintf(w, "\nrepair: %d outbox event(s) enqueued, %d document(s) removed; run reconcile again once the pipeline has drained\n", fixed.Enqueued, fixed.Removed)
		if kept := fixed.KeptTombstones + fixed.KeptUnowned + fixed.KeptChanged + fixed.KeptReappeared; kept > 0 {
			fmt.Fprintf(w, "kept: %d tombstone(s), %d without this aggregate type, %d written since the comparison, %d whose row arrived since\n",
				fixed.KeptTombstones, fixed.KeptUnowned, fixed.KeptChanged, fixed.KeptReappeared)
		}
	} else if rep.Clean() {
		fmt.Fprintln(w, "\nno drift")
	}
}

// listDrifts prints one kind of drift as a table under header (columns
// separated by tabs), a row per drift as row formats it, the first show of
// them.
func listDrifts(w io.Writer, kind, header string, ds []reconcile.Drift, show int, row func(reconcile.Drift) string) {
	if len(ds) == 0 {
		return
	}
	fmt.Fprintf(w, "\n%s:\n", kind)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  "+header)
	for i, d := range ds {
		if i == show {
			fmt.Fprintf(tw, "  … %d more\n", len(ds)-show)
			break
		}
		fmt.Fprintln(tw, "  "+row(d))
	}
	tw.Flush()
}

func orDash(v int64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprint(v)
}

func indexExists(ctx context.Context, client *elastic.Client, index string) (bool, error) {
	ok, err := client.IndexExists(index).Do(ctx)
	if err != nil {
		return false, fmt.Errorf("look up index %s: %w", index, err)
	}
	return ok, nil
}

// reconcileSourceTable is `reconcile --job J --source-table`.
func reconcileSourceTable(ctx context.Context, stdout io.Writer, pool *pgxpool.Pool, cfg reconcile.Config, job string, repair, asJSON bool, show int) error {
	spec, err := batch.LoadJobSpec(ctx, pool, job)
	if errors.Is(err, batch.ErrNotFound) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: err}
	}
	if err != nil {
		return err
	}
	rep, err := reconcile.RunSourceTable(ctx, cfg, spec)
	if errors.Is(err, batch.ErrSpec) {
		return &cli.ExitError{Code: cli.ExitConflict, Err: fmt.Errorf("the stored spec of job %s no longer fits its table: %w", job, err)}
	}
	if err != nil {
		return err
	}
	var fixed *reconcile.GoneRepair
	if repair && rep.GoneCount > 0 {
		res, err := reconcile.RepairGone(ctx, cfg, spec, rep)
		if errors.Is(err, reconcile.ErrRepairTooLarge) {
			printSourceReport(stdout, rep, nil, show)
			return cli.UsageError("%v (--force)", err)
		}
		if err != nil {
			return err
		}
		fixed = &res
	}
	if asJSON {
		if err := cli.WriteJSON(stdout, struct {
			reconcile.SourceReport
			Repair *reconcile.GoneRepair `json:"repair,omitempty"`
		}{rep, fixed}); err != nil {
			return err
		}
	} else {
		printSourceReport(stdout, rep, fixed, show)
	}
	switch {
	case rep.Clean():
		return nil
	case fixed == nil:
		return &cli.ExitError{Code: cli.ExitDrift, Err: fmt.Errorf("drift from the source table: %d gone, %d missing, %d behind (--repair deletes the gone; a run of job %s carries the others)",
			rep.GoneCount, rep.MissingCount, rep.BehindCount, job)}
	case rep.MissingCount+rep.BehindCount > 0:
		return &cli.ExitError{Code: cli.ExitDrift, Err: fmt.Errorf("%d missing and %d behind are not repaired by --source-table: run job %s (batcher run)",
			rep.MissingCount, rep.BehindCount, job)}
	}
	return nil
}

func printSourceReport(w io.Writer, rep reconcile.SourceReport, fixed *reconcile.GoneRepair, show int) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "job\t%s\t(source table %s, source %s, aggregate type %s)\n", rep.Job, rep.Table, rep.Source, rep.AggregateType)
	fmt.Fprintf(tw, "rows in scope\t%d\t(live: not soft-deleted, not quarantined)\n", rep.SourceRows)
	fmt.Fprintf(tw, "index documents\t%d\t(live, of this aggregate type or none)\n", rep.IndexDocs)
	fmt.Fprintf(tw, "buckets differing\t%d of %d\n", len(rep.DifferingBuckets), sink.Buckets)
	fmt.Fprintf(tw, "documents read\t%d\t(only in differing buckets)\n", rep.DocsRead)
	fmt.Fprintf(tw, "gone\t%d\t(live in the index; source row deleted or out of scope)\n", rep.GoneCount)
	fmt.Fprintf(tw, "missing\t%d\t(live row in scope, no live document)\n", rep.MissingCount)
	fmt.Fprintf(tw, "behind\t%d\t(document older than the row, or live while the row is soft-deleted)\n", rep.BehindCount)
	if rep.Quarantined > 0 {
		fmt.Fprintf(tw, "quarantined\t%d\t(rows in scope a run quarantined; not compared)\n", rep.Quarantined)
	}
	fmt.Fprintf(tw, "took\t%s\n", rep.Took.Round(1e6))
	tw.Flush()
	list := func(kind string, ds []reconcile.Drift) {
		listDrifts(w, kind, "ID\tROW VERSION\tROW DELETED\tINDEX VERSION\tINDEX DELETED", ds, show, func(d reconcile.Drift) string {
			return fmt.Sprintf("%s\t%s\t%v\t%s\t%v", d.ID, orDash(d.SourceVersion), d.SourceDeleted, orDash(d.IndexVersion), d.IndexDeleted)
		})
	}
	list("gone (live in the index, source row deleted or out of scope)", rep.Gone)
	list("missing (live row in scope, no live document)", rep.Missing)
	list("behind (the index holds an older version)", rep.Behind)
	switch {
	case fixed != nil:
		fmt.Fprintf(w, "\nrepair: %d tombstone(s) and delete event(s) enqueued; the publisher and the indexer carry them; run reconcile --source-table again once the pipeline has drained\n", fixed.Enqueued)
		for i, id := range fixed.IDs {
			if i == show {
				fmt.Fprintf(w, "  … %d more\n", len(fixed.IDs)-show)
				break
			}
			fmt.Fprintf(w, "  %s\n", id)
		}
		if fixed.KeptUnowned+fixed.KeptBack+fixed.Pending > 0 {
			fmt.Fprintf(w, "kept: %d without this aggregate type, %d back in scope or changed since the comparison, %d with a tombstone on its way already\n",
				fixed.KeptUnowned, fixed.KeptBack, fixed.Pending)
		}
	case rep.Clean():
		fmt.Fprintln(w, "\nno drift from the source table")
	}
}
