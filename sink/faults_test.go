package sink

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// faultInjector is an httptest server in front of the real engine. Bulk
// requests pass through it item by item: items it is told to fail get a
// synthetic error answer and are NOT forwarded, the rest reach the real
// engine, and the answers are merged back in request order. So a "partial
// bulk failure" is a real one from the indexer's point of view, and the
// data that did get through is really in the index.
type itemFault struct {
	times  int
	answer bulkItemResult
}

type faultInjector struct {
	srv    *httptest.Server
	target *url.URL

	mu sync.Mutex
	// failRequests: the next N bulk requests are answered with this status
	// as a whole.
	failRequests       int
	failRequestsStatus int
	// refuseRequestsWith: id → status of the answer to every bulk request
	// that holds it, as a whole (as OpenSearch answers 400 to a bulk with one
	// invalid action).
	refuseRequestsWith map[string]int
	// refuseAllPlain, when set, is the status of a plain-text answer (a
	// proxy's, not the engine's JSON error) to every bulk request.
	refuseAllPlain int
	// failItems: id → how many more times its bulk item fails, and how.
	failItems map[string]*itemFault
	// bulks records the ids of every bulk request that reached the engine.
	bulks [][]string
	// mgetDocErrors: the next N _mget requests are answered 200 with an
	// error for every document (as for a shard that is not available), not
	// forwarded; mgets counts the _mget requests.
	mgetDocErrors, mgets int
}

func newFaultInjector(t testing.TB, target string) *faultInjector {
	t.Helper()
	u, err := url.Parse(target)
	require.NoError(t, err)
	fi := &faultInjector{target: u, failItems: map[string]*itemFault{}, refuseRequestsWith: map[string]int{}}
	proxy := httputil.NewSingleHostReverseProxy(u)
	fi.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/_bulk" {
			fi.bulk(w, r)
			return
		}
		if r.Method == http.MethodPost && r.URL.Path == "/_mget" && fi.mget(w, r) {
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(fi.srv.Close)
	return fi
}

func (fi *faultInjector) URL() string { return fi.srv.URL }

func (fi *faultInjector) failNextRequests(n, status int) {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	fi.failRequests, fi.failRequestsStatus = n, status
}

func (fi *faultInjector) refuseRequestsHolding(id string, status int) {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	fi.refuseRequestsWith[id] = status
}

func (fi *faultInjector) refuseAllPlainText(status int) {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	fi.refuseAllPlain = status
}

func (fi *faultInjector) failItem(id string, times, status int, typ string) {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	f := &itemFault{times: times, answer: bulkItemResult{Status: status}}
	fi.failItems[id] = f
	f.answer.Error = &bulkItemError{typ, "injected by the test"}
}

func (fi *faultInjector) failNextMgetDocs(n int) {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	fi.mgetDocErrors = n
}

// mget answers an _mget request with an error per document if told to;
// otherwise it restores the body for the proxy and returns false.
func (fi *faultInjector) mget(w http.ResponseWriter, r *http.Request) bool {
	body, _ := io.ReadAll(r.Body)
	fi.mu.Lock()
	fi.mgets++
	fail := fi.mgetDocErrors > 0
	if fail {
		fi.mgetDocErrors--
	}
	fi.mu.Unlock()
	if !fail {
		r.Body = io.NopCloser(bytes.NewReader(body))
		return false
	}
	var req struct {
		Docs []struct {
			Index string `json:"_index"`
			ID    string `json:"_id"`
		} `json:"docs"`
	}
	_ = json.Unmarshal(body, &req)
	type docError struct {
		Index string         `json:"_index"`
		ID    string         `json:"_id"`
		Error map[string]any `json:"error"`
	}
	var res struct {
		Docs []docError `json:"docs"`
	}
	for _, d := range req.Docs {
		res.Docs = append(res.Docs, docError{d.Index, d.ID, map[string]any{"type": "no_shard_available_action_exception", "reason": "injected by the test"}})
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(res)
	return true
}

func (fi *faultInjector) mgetCount() int {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	return fi.mgets
}

func (fi *faultInjector) bulkIDs() [][]string {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	return append([][]string(nil), fi.bulks...)
}

func (fi *faultInjector) bulk(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	fi.mu.Lock()
	if fi.failRequests > 0 {
		fi.failRequests--
		status := fi.failRequestsStatus
		fi.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"error":{"type":"es_rejected_execution_exception","reason":"injected"},"status":%d}`, status)
		return
	}
	// Split into (action, source) pairs and decide per item.
	type pair struct{ action, source []byte }
	var pairs []pair
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		a := append([]byte(nil), sc.Bytes()...)
		sc.Scan()
		pairs = append(pairs, pair{a, append([]byte(nil), sc.Bytes()...)})
	}
	answers := make([]json.RawMessage, len(pairs))
	var forward bytes.Buffer
	var forwardIdx []int
	var ids []string
	for i, p := range pairs {
		var a map[string]struct {
			ID string `json:"_id"`
		}
		_ = json.Unmarshal(p.action, &a)
		id := a["index"].ID
		ids = append(ids, id)
		if f := fi.failItems[id]; f != nil && f.times > 0 {
			f.times--
			b, _ := json.Marshal(map[string]bulkItemResult{"index": f.answer})
			answers[i] = b
			continue
		}
		forward.Write(p.action)
		forward.WriteByte('\n')
		forward.Write(p.source)
		forward.WriteByte('\n')
		forwardIdx = append(forwardIdx, i)
	}
	fi.bulks = append(fi.bulks, ids)
	if status := fi.refuseAllPlain; status != 0 {
		fi.mu.Unlock()
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(status)
		fmt.Fprint(w, "<html><body><h1>400 Bad Request</h1>injected by a proxy</body></html>")
		return
	}
	for _, id := range ids {
		if status := fi.refuseRequestsWith[id]; status != 0 {
			fi.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			fmt.Fprintf(w, `{"error":{"type":"illegal_argument_exception","reason":"injected: refused for %s"},"status":%d}`, id, status)
			return
		}
	}
	fi.mu.Unlock()
	if len(forwardIdx) > 0 {
		u := *fi.target
		u.Path, u.RawQuery = "/_bulk", r.URL.RawQuery
		res, err := http.Post(u.String(), "application/x-ndjson", &forward)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer res.Body.Close()
		rb, _ := io.ReadAll(res.Body)
		if res.StatusCode != http.StatusOK {
			w.WriteHeader(res.StatusCode)
			_, _ = w.Write(rb)
			return
		}
		var br struct {
			Items []json.RawMessage `json:"items"`
		}
		if err := json.Unmarshal(rb, &br); err != nil || len(br.Items) != len(forwardIdx) {
			http.Error(w, "injector: bad engine answer: "+string(rb), http.StatusBadGateway)
			return
		}
		for j, i := range forwardIdx {
			answers[i] = br.Items[j]
		}
	}
	w.Header().Set("Content-Type", "application/json")
	out, _ := json.Marshal(map[string]any{"errors": true, "items": answers})
	_, _ = w.Write(out)
}
