// Package bench_batcher measures the batcher against the raw write speed of
// the same tables: 1,000,000 (and 100,000) source rows of ~500-byte JSON are
// normalized into normalized_records and outbox_events by the real batcher
// binary (built-in normalizers compiled to SQL), by a custom Go Processor
// (read → Go → unnest write) in process, and by a baseline that COPYs the
// equivalent rows and events from memory, 5,000 per transaction. The three
// run interleaved for BENCH_REPEATS rounds (default 3) and the medians are
// reported with their spread: the machine is shared and noisy. Every
// contender must leave the same rows, events and document bytes behind.
// BENCH_ROWS (default 100000,1000000) picks the sizes.
//
// Run with `make bench-batcher`:
//
//	go test -run '^$' -bench . -benchtime 1x -timeout 60m ./bench/batcher/
package bench_batcher
