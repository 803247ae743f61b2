package docs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
)

// A page's run leaves its topics (and the indexer's .dlq beside each) and
// its indices and aliases on the shared stack, all named after its run id.
// cleanupRun deletes them after the page (its processes stopped first, so
// none recreates them); runLeftovers lists what is left.

// cleanupRun deletes the Kafka topics whose names contain runID and the
// search indices matching *runID* (their aliases go with them).
func (e *runEnv) cleanupRun(ctx context.Context, runID string) error {
	topics, indices, err := e.runLeftovers(ctx, runID)
	if err != nil {
		return err
	}
	var errs []error
	if len(topics) > 0 {
		c, done := e.kafkaClient()
		defer done()
		res, err := c.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: topics})
		if err != nil {
			errs = append(errs, fmt.Errorf("delete topics %v: %w", topics, err))
		} else {
			for topic, err := range res.Errors {
				if err != nil && !errors.Is(err, kafka.UnknownTopicOrPartition) {
					errs = append(errs, fmt.Errorf("delete topic %s: %w", topic, err))
				}
			}
		}
	}
	if len(indices) > 0 {
		// By name: the engine may refuse wildcard deletes
		// (action.destructive_requires_name).
		if _, err := e.searchDo(ctx, http.MethodDelete, "/"+url.PathEscape(strings.Join(indices, ","))+"?ignore_unavailable=true"); err != nil {
			errs = append(errs, fmt.Errorf("delete indices %v: %w", indices, err))
		}
	}
	return errors.Join(errs...)
}

// runLeftovers are the topics whose names contain runID and the indices
// (hidden and closed ones too) that match *runID* or that an alias
// matching *runID* points to.
func (e *runEnv) runLeftovers(ctx context.Context, runID string) (topics, indices []string, err error) {
	c, done := e.kafkaClient()
	defer done()
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{})
	if err != nil {
		return nil, nil, fmt.Errorf("kafka metadata: %w", err)
	}
	for _, t := range md.Topics {
		if strings.Contains(t.Name, runID) {
			topics = append(topics, t.Name)
		}
	}
	sort.Strings(topics)

	b, err := e.searchDo(ctx, http.MethodGet, "/_resolve/index/*"+url.PathEscape(runID)+"*?expand_wildcards=all")
	if err != nil {
		return nil, nil, err
	}
	var res struct {
		Indices []struct {
			Name string `json:"name"`
		} `json:"indices"`
		Aliases []struct {
			Name    string   `json:"name"`
			Indices []string `json:"indices"`
		} `json:"aliases"`
	}
	if err := json.Unmarshal(b, &res); err != nil {
		return nil, nil, fmt.Errorf("_resolve/index: %w: %s", err, b)
	}
	seen := map[string]bool{}
	for _, i := range res.Indices {
		seen[i.Name] = true
	}
	for _, a := range res.Aliases {
		for _, i := range a.Indices {
			seen[i] = true
		}
	}
	for i := range seen {
		indices = append(indices, i)
	}
	sort.Strings(indices)
	return topics, indices, nil
}

// kafkaClient is a client of the shared brokers with a transport of its
// own: kafka-go's default transport answers a metadata request from a
// cache up to 6 s old, which misses the topics a page has just created.
func (e *runEnv) kafkaClient() (*kafka.Client, func()) {
	tr := &kafka.Transport{}
	c := &kafka.Client{Addr: kafka.TCP(strings.Split(e.kafka, ",")...), Timeout: 30 * time.Second, Transport: tr}
	return c, tr.CloseIdleConnections
}

// searchDo sends a request to the shared search engine; a status other
// than 2xx is an error.
func (e *runEnv) searchDo(ctx context.Context, method, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimRight(e.search, "/")+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		return b, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, b)
	}
	return b, nil
}
