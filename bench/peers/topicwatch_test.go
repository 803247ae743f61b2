package bench_peers

import (
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// topicWatch reads every partition of a topic from its end and notes when
// each mark (any number under a "mark" key, at any depth of a message's
// JSON value) first arrived: with the writer's commit times, commit → on
// the topic, which splits a commit → searchable latency into the batcher
// and publisher's part and the indexer and engine's part.
type topicWatch struct {
	mu     sync.Mutex
	first  map[int64]time.Time
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// watchTopic starts reading topic's partitions (from their current ends).
func watchTopic(b testing.TB, brokers []string, topic string) *topicWatch {
	ctx, cancel := context.WithCancel(context.Background())
	tw := &topicWatch{first: map[int64]time.Time{}, cancel: cancel}
	conn, err := kafka.Dial("tcp", brokers[0])
	check(b, err)
	parts, err := conn.ReadPartitions(topic)
	_ = conn.Close()
	check(b, err)
	for _, p := range parts {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p.ID, MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 100 * time.Millisecond})
		check(b, r.SetOffset(kafka.LastOffset))
		tw.wg.Add(1)
		go func() {
			defer tw.wg.Done()
			defer r.Close()
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					if errors.Is(err, context.Canceled) || ctx.Err() != nil {
						return
					}
					continue
				}
				now := time.Now()
				var v any
				if json.Unmarshal(m.Value, &v) != nil {
					continue
				}
				tw.mu.Lock()
				eachMark(v, func(mark int64) {
					if _, ok := tw.first[mark]; !ok {
						tw.first[mark] = now
					}
				})
				tw.mu.Unlock()
			}
		}()
	}
	return tw
}

// eachMark calls f with every integer under a "mark" key in v.
func eachMark(v any, f func(int64)) {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			if n, ok := x.(float64); ok && k == "mark" {
				f(int64(n))
				continue
			}
			eachMark(x, f)
		}
	case []any:
		for _, x := range v {
			eachMark(x, f)
		}
	}
}

// seen returns when mark first arrived on the topic.
func (tw *topicWatch) seen(mark int64) (time.Time, bool) {
	tw.mu.Lock()
	defer tw.mu.Unlock()
	t, ok := tw.first[mark]
	return t, ok
}

func (tw *topicWatch) stop() { tw.cancel(); tw.wg.Wait() }

// engineStats is what the engine did on an index's primaries so far.
type engineStats struct {
	Refresh struct {
		Total  int64 `json:"total"`
		Millis int64 `json:"total_time_in_millis"`
	} `json:"refresh"`
	Merges struct {
		Current int64 `json:"current"`
		Total   int64 `json:"total"`
		Millis  int64 `json:"total_time_in_millis"`
	} `json:"merges"`
}

func indexStats(search, index string) (engineStats, error) {
	resp, err := httpClient.Get(strings.TrimRight(search, "/") + "/" + url.PathEscape(index) + "/_stats/refresh,merge")
	if err != nil {
		return engineStats{}, err
	}
	defer resp.Body.Close()
	var res struct {
		All struct {
			Primaries engineStats `json:"primaries"`
		} `json:"_all"`
	}
	err = json.NewDecoder(resp.Body).Decode(&res)
	return res.All.Primaries, err
}

// waitMerges waits (at most timeout) until the engine runs no merge on
// index: a leg then measures its own changes, not the merges of the leg
// before it (10,000 products re-indexed by a rename).
func waitMerges(b testing.TB, search, index string, timeout time.Duration) {
	start := time.Now()
	tick := time.NewTicker(pollEvery * 5)
	defer tick.Stop()
	for range tick.C {
		st, err := indexStats(search, index)
		if err == nil && st.Merges.Current == 0 {
			b.Logf("%s: no merge running (waited %.1f s; merges so far %d, %.1f s)", index, time.Since(start).Seconds(), st.Merges.Total, float64(st.Merges.Millis)/1000)
			return
		}
		if time.Since(start) > timeout {
			b.Logf("%s: merges still running after %s; measuring anyway", index, timeout)
			return
		}
	}
}
