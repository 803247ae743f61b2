package e2e

import (
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// waitReadyz polls url/readyz until it answers code with a body containing
// want, and returns the body.
func waitReadyz(t *testing.T, url string, code int, want string, timeout time.Duration, proc *testproc.Proc) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	last := ""
	for {
		resp, err := http.Get(url + "/readyz")
		if err == nil {
			var b strings.Builder
			_, _ = io.Copy(&b, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == code && strings.Contains(b.String(), want) {
				return b.String()
			}
			last = resp.Status + ": " + b.String()
		} else {
			last = err.Error()
		}
		select {
		case <-proc.Done():
			t.Fatalf("process exited (code %d) while waiting for /readyz %d %q; last: %s\n%s", proc.ExitCode(), code, want, last, tail(proc.Stderr(), 20))
		default:
		}
		require.Truef(t, time.Now().Before(deadline), "/readyz not %d %q within %s; last: %s\n%s", code, want, timeout, last, tail(proc.Stderr(), 20))
		pause(t.Context(), 200*time.Millisecond)
	}
}

// cuttableProxy forwards TCP connections to a real server until cut, which
// closes the listener and every connection: the server becomes unreachable
// for the client without stopping it (the shared PostgreSQL must keep
// running for the other tests).
type cuttableProxy struct {
	addr, target string
	mu           sync.Mutex
	ln           net.Listener
	conns        []net.Conn
}

func newCuttableProxy(t *testing.T, target string) *cuttableProxy {
	t.Helper()
	p := &cuttableProxy{addr: freeAddr(t), target: target}
	require.NoError(t, p.restore())
	t.Cleanup(p.cut)
	return p
}

func (p *cuttableProxy) restore() error {
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", p.target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(s, c); s.Close() }()
			go func() { _, _ = io.Copy(c, s); c.Close() }()
		}
	}()
	return nil
}

func (p *cuttableProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// The publisher's /readyz fails while its database is unreachable, saying
// so, and recovers with it; the indexer's is ready once it is in its group.
func TestReadyzSaysWhyAServiceCannotWork(t *testing.T) {
	t.Parallel()
	dbURL, err := url.Parse(stack.Database(t))
	require.NoError(t, err)
	proxy := newCuttableProxy(t, dbURL.Host)
	dbURL.Host = proxy.addr
	pubBin := testproc.Build(t, "publisher")

	addr := freeAddr(t)
	pub := testproc.Start(t, pubBin, []string{"DATABASE_URL=" + dbURL.String(), "KAFKA_BROKERS=" + strings.Join(stack.KafkaBrokers(t), ","),
		"METRICS_ADDR=" + addr, "LEASE_TTL=2s", "LOG_LEVEL=warn"}, "run")
	waitReadyz(t, "http://"+addr, http.StatusOK, "ready", 2*time.Minute, pub)

	proxy.cut()
	body := waitReadyz(t, "http://"+addr, http.StatusServiceUnavailable, "postgres: ", time.Minute, pub)
	t.Logf("publisher /readyz with its database unreachable: %s", body)

	require.NoError(t, proxy.restore())
	waitReadyz(t, "http://"+addr, http.StatusOK, "ready", 2*time.Minute, pub)

	p := newPipeline(t, pipelineOptions{TopicPartitions: 2})
	ixAddr := freeAddr(t)
	ix := p.startIndexer("METRICS_ADDR="+ixAddr, "LOG_LEVEL=warn")
	waitReadyz(t, "http://"+ixAddr, http.StatusOK, "ready", 2*time.Minute, ix)
}
