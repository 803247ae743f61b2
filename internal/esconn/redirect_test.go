package esconn_test

import (
	"encoding/base64"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/esconn"
)

// recorder is a server that records the Authorization header of every
// request it gets.
type recorder struct {
	mu   sync.Mutex
	auth []string
	srv  *httptest.Server
}

func newRecorder(t *testing.T, listen string, h http.HandlerFunc) *recorder {
	t.Helper()
	r := &recorder{}
	ln, err := net.Listen("tcp", listen)
	require.NoError(t, err)
	r.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.auth = append(r.auth, req.Header.Get("Authorization"))
		r.mu.Unlock()
		if h != nil {
			h(w, req)
			return
		}
		_, _ = w.Write([]byte(`{}`))
	}))
	r.srv.Listener.Close()
	r.srv.Listener = ln
	r.srv.Start()
	t.Cleanup(r.srv.Close)
	return r
}

func (r *recorder) got() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.auth...)
}

// The credentials go to the configured hosts only: a node that redirects
// to another host (here 127.0.0.2, a different address) does not hand it
// the basic auth password or the API key, whether the redirect is refused
// or followed without them. A redirect within the configured node keeps
// them.
func TestRedirectToAnotherHostGetsNoCredentials(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		s    esconn.Settings
		user string // user info in the URL
		want string
	}{
		{"basic auth", esconn.Settings{}, "elastic:s3cret@", "Basic " + base64.StdEncoding.EncodeToString([]byte("elastic:s3cret"))},
		{"API key", esconn.Settings{APIKey: "id:s3cret"}, "", "ApiKey " + base64.StdEncoding.EncodeToString([]byte("id:s3cret"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			other := newRecorder(t, "127.0.0.2:0", nil)
			node := newRecorder(t, "127.0.0.1:0", func(w http.ResponseWriter, r *http.Request) {
				switch r.URL.Path {
				case "/away":
					http.Redirect(w, r, other.srv.URL+"/stolen", http.StatusFound)
				case "/here":
					http.Redirect(w, r, "/landed", http.StatusFound)
				default:
					_, _ = w.Write([]byte(`{}`))
				}
			})
			conn, err := tc.s.Build("http://" + tc.user + node.srv.Listener.Addr().String())
			require.NoError(t, err)

			_, err = conn.HTTP.Get(node.srv.URL + "/away") //nolint:bodyclose // refused: no response
			require.ErrorContains(t, err, "redirect to "+other.srv.URL+"/stolen refused")
			for _, a := range other.got() {
				require.Empty(t, a, "the other host received credentials")
			}

			resp, err := conn.HTTP.Get(node.srv.URL + "/here")
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, []string{tc.want, tc.want, tc.want}, node.got()) // /away, /here, /landed
		})
	}
}

// An https node that redirects to http:// (a downgrade) is not followed
// with the credentials either.
func TestRedirectToPlainHTTPGetsNoCredentials(t *testing.T) {
	t.Parallel()
	plain := newRecorder(t, "127.0.0.1:0", nil)
	tlsNode := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, plain.srv.URL+"/stolen", http.StatusFound)
	}))
	defer tlsNode.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	require.NoError(t, os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: tlsNode.Certificate().Raw}), 0o600))
	conn, err := esconn.Settings{Username: "elastic", Password: "s3cret", CAFile: ca}.Build(tlsNode.URL)
	require.NoError(t, err)
	_, err = conn.HTTP.Get(tlsNode.URL + "/") //nolint:bodyclose // refused: no response
	require.ErrorContains(t, err, "refused")
	for _, a := range plain.got() {
		require.Empty(t, a, "the plain http endpoint received credentials")
	}
}

// The transport itself sends the credentials only to the configured nodes:
// a request to any other address made with the client (not only a
// redirect, which the client refuses first) goes without them.
func TestCredentialsOnlyToConfiguredNodes(t *testing.T) {
	t.Parallel()
	other := newRecorder(t, "127.0.0.2:0", nil)
	node := newRecorder(t, "127.0.0.1:0", nil)
	conn, err := esconn.Settings{APIKey: "id:s3cret"}.Build(node.srv.URL)
	require.NoError(t, err)
	for _, u := range []string{node.srv.URL, other.srv.URL} {
		resp, err := conn.HTTP.Get(u + "/")
		require.NoError(t, err)
		resp.Body.Close()
	}
	require.Equal(t, []string{"ApiKey " + base64.StdEncoding.EncodeToString([]byte("id:s3cret"))}, node.got())
	require.Equal(t, []string{""}, other.got())
}
