package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/olivere/elastic/v7"

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
				asJSON      bool
				limit, show int
				es          esconn.Settings
			)
			fs := cli.NewFlagSet("indexer reconcile", "Summarises both sides per id bucket (count and a hash of id, version, deleted, processor version), reads id by id\nonly the buckets that differ, and reports missing, stale and extra documents. Run it when the\npipeline is drained: events in flight show up as drift. Exit code 4 when drift is found and not\nrepaired.")
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
			client, err := sink.NewClientWith(conn.URL, conn.HTTP)
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
				cfg.Source, cfg.ProcessorVersion, cfg.AggregateType = j.SourceName, j.ProcessorVersion, j.AggregateType
				cfg.Topic = cmp.Or(j.Topic, topic)
				routes, err := sink.ParseRoutes(routesFlag)
				if err != nil {
					return cli.UsageError("%v", err)
				}
				routed := sink.Config{Alias: alias, Routes: routes}.ForAggregateType(j.AggregateType)
				if cfg.Index, err = sink.GenerationTarget(ctx, client, routed.Alias, j.ProcessorVersion); err != nil {
					return err
				}
				if ok, err := indexExists(ctx, client, cfg.Index); err != nil {
					return err
				} else if !ok {
					return &cli.ExitError{Code: cli.ExitConflict, Err: fmt.Errorf("job %s is at processor version %s, whose index generation %s does not exist yet (no indexer has seen its events)", job, j.ProcessorVersion, cfg.Index)}
				}
			} else if gens, err := sink.Generations(ctx, client, alias, cfg.Index); err == nil {
				// The live generation's processor version is the expected one.
				for _, g := range gens {
					if g.Writes {
						cfg.ProcessorVersion = g.Meta.ProcessorVersion
					}
				}
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
		if len(ds) == 0 {
			return
		}
		fmt.Fprintf(w, "\n%s:\n", kind)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  ID\tSOURCE VERSION\tSOURCE DELETED\tSOURCE PV\tINDEX VERSION\tINDEX DELETED\tINDEX PV")
		for i, d := range ds {
			if i == show {
				fmt.Fprintf(tw, "  … %d more\n", len(ds)-show)
				break
			}
			fmt.Fprintf(tw, "  %s\t%s\t%v\t%s\t%s\t%v\t%s\n", d.ID, orDash(d.SourceVersion), d.SourceDeleted, cmp.Or(d.SourcePV, "-"),
				orDash(d.IndexVersion), d.IndexDeleted, cmp.Or(d.IndexPV, "-"))
		}
		tw.Flush()
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
