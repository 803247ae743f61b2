package esconn_test

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/esconn"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

func TestBuildSettings(t *testing.T) {
	t.Parallel()
	pw := filepath.Join(t.TempDir(), "pw")
	require.NoError(t, os.WriteFile(pw, []byte("s3cret\n"), 0o600))
	keyFile := filepath.Join(t.TempDir(), "api-key")
	require.NoError(t, os.WriteFile(keyFile, []byte("id2:key2\n"), 0o600))
	for _, tc := range []struct {
		name string
		url  string
		s    esconn.Settings
		want string
	}{
		{"not a URL", "127.0.0.1:9200", esconn.Settings{}, "ELASTICSEARCH_URL"},
		{"user without password", "https://h:9200", esconn.Settings{Username: "elastic"}, "ELASTICSEARCH_PASSWORD"},
		{"password without user", "https://h:9200", esconn.Settings{Password: "s3cret"}, "ELASTICSEARCH_USERNAME"},
		{"password and file", "https://h:9200", esconn.Settings{Username: "u", Password: "s3cret", PasswordFile: pw}, "ELASTICSEARCH_PASSWORD_FILE"},
		{"URL user info and username", "https://u:s3cret@h:9200", esconn.Settings{Username: "u", Password: "x"}, "ELASTICSEARCH_URL"},
		{"API key and basic auth", "https://u:s3cret@h:9200", esconn.Settings{APIKey: "k"}, "ELASTICSEARCH_API_KEY"},
		{"API key and file", "https://h:9200", esconn.Settings{APIKey: "s3cret", APIKeyFile: keyFile}, "ELASTICSEARCH_API_KEY_FILE"},
		{"missing API key file", "https://h:9200", esconn.Settings{APIKeyFile: pw + ".none"}, "ELASTICSEARCH_API_KEY_FILE"},
		{"cert without key", "https://h:9200", esconn.Settings{CertFile: pw}, "ELASTICSEARCH_KEY_FILE"},
		{"CA without PEM", "https://h:9200", esconn.Settings{CAFile: pw}, "ELASTICSEARCH_CA_FILE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.s.Build(tc.url)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "s3cret")
		})
	}

	// User info in the URL becomes basic auth and leaves the URL; an
	// "id:key" API key is encoded the way the engine expects.
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.Header.Get("Authorization"))
		_, _ = w.Write([]byte(`{}`))
	}))
	defer srv.Close()
	conn, err := esconn.Settings{}.Build("http://elastic:s3cret@" + srv.Listener.Addr().String())
	require.NoError(t, err)
	require.Equal(t, srv.URL, conn.URL)
	require.NoError(t, conn.Probe(context.Background(), nil))
	conn, err = esconn.Settings{APIKey: "id1:key1"}.Build(srv.URL)
	require.NoError(t, err)
	require.NoError(t, conn.Probe(context.Background(), nil))
	conn, err = esconn.Settings{APIKeyFile: keyFile}.Build(srv.URL) // the trailing newline is dropped
	require.NoError(t, err)
	require.NoError(t, conn.Probe(context.Background(), nil))
	require.Equal(t, []string{
		"Basic " + base64.StdEncoding.EncodeToString([]byte("elastic:s3cret")),
		"ApiKey " + base64.StdEncoding.EncodeToString([]byte("id1:key1")),
		"ApiKey " + base64.StdEncoding.EncodeToString([]byte("id2:key2")),
	}, got)
}

// Against the engine behind nginx: each credential works end to end (a
// document is written and read back through the secured endpoint), and each
// wrong one fails the probe at once, in one line naming the setting.
func TestSecuredSearchEndpoint(t *testing.T) {
	t.Parallel()
	ss := stack.SecuredSearch(t)
	env := ss.Settings
	ca := env["ELASTICSEARCH_CA_FILE"]
	basic, apikey, mtls := env["SEARCH_BASIC_URL"], env["SEARCH_APIKEY_URL"], env["SEARCH_MTLS_URL"]
	user, pass := env["ELASTICSEARCH_USERNAME"], env["ELASTICSEARCH_PASSWORD"]
	pwFile := filepath.Join(t.TempDir(), "pw")
	require.NoError(t, os.WriteFile(pwFile, []byte(pass+"\n"), 0o600))

	t.Run("works", func(t *testing.T) {
		for _, tc := range []struct {
			name, url string
			s         esconn.Settings
		}{
			{"basic auth", basic, esconn.Settings{CAFile: ca, Username: user, PasswordFile: pwFile}},
			{"user info in the URL", "https://" + user + ":" + pass + "@" + basic[len("https://"):], esconn.Settings{CAFile: ca}},
			{"API key", apikey, esconn.Settings{CAFile: ca, APIKey: env["ELASTICSEARCH_API_KEY"]}},
			{"client certificate", mtls, esconn.Settings{CAFile: ca, CertFile: env["ELASTICSEARCH_CERT_FILE"], KeyFile: env["ELASTICSEARCH_KEY_FILE"]}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				conn, err := tc.s.Build(tc.url)
				require.NoError(t, err)
				require.NotContains(t, conn.URL, pass)
				require.NoError(t, conn.Probe(ctx, nil))
				c, err := index.NewClientWith(conn.URL, conn.HTTP)
				require.NoError(t, err)
				index := stack.UniqueName("esconn")
				defer func() { _, _ = c.DeleteIndex(index).Do(context.Background()) }()
				_, err = c.Index().Index(index).Id("1").BodyJson(map[string]any{"via": tc.name}).Refresh("true").Do(ctx)
				require.NoError(t, err)
				doc, err := c.Get().Index(index).Id("1").Do(ctx)
				require.NoError(t, err)
				require.True(t, doc.Found)
			})
		}
	})

	const wrong = "wrong-password-456"
	for _, tc := range []struct {
		name, url string
		s         esconn.Settings
		want      string
	}{
		{"wrong password", basic, esconn.Settings{CAFile: ca, Username: user, Password: wrong}, "ELASTICSEARCH_PASSWORD"},
		{"no credentials", basic, esconn.Settings{CAFile: ca}, "ELASTICSEARCH_USERNAME"},
		{"wrong password in the URL", "https://" + user + ":" + wrong + "@" + basic[len("https://"):], esconn.Settings{CAFile: ca}, "ELASTICSEARCH_PASSWORD"},
		{"wrong API key", apikey, esconn.Settings{CAFile: ca, APIKey: "test-id:" + wrong}, "ELASTICSEARCH_API_KEY"},
		{"untrusted CA", basic, esconn.Settings{CAFile: env["SEARCH_OTHER_CA_FILE"], Username: user, Password: wrong}, "ELASTICSEARCH_CA_FILE"},
		{"system roots only", basic, esconn.Settings{Username: user, Password: wrong}, "ELASTICSEARCH_CA_FILE"},
		{"no client certificate", mtls, esconn.Settings{CAFile: ca}, "ELASTICSEARCH_CERT_FILE"},
		{"untrusted client certificate", mtls, esconn.Settings{CAFile: ca, CertFile: env["SEARCH_OTHER_CERT_FILE"], KeyFile: env["SEARCH_OTHER_KEY_FILE"]}, "ELASTICSEARCH_CERT_FILE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			conn, err := tc.s.Build(tc.url)
			require.NoError(t, err)
			start := time.Now()
			err = conn.Probe(context.Background(), nil)
			took := time.Since(start)
			require.Error(t, err)
			var pe *esconn.ProbeError
			require.ErrorAs(t, err, &pe)
			t.Logf("%s after %s: %s", tc.name, took.Round(time.Millisecond), err)
			require.Less(t, took, esconn.ProbeLimit)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "\n")
			require.NotContains(t, err.Error(), wrong)
			require.NotContains(t, err.Error(), pass)
		})
	}
}

// ELASTICSEARCH_URL may list a cluster's nodes: user info given once
// applies to all and leaves every URL, the probe asks every node (a wrong
// password on the second is refused like on the first), and a list whose
// nodes carry different credentials is refused.
func TestBuildNodeList(t *testing.T) {
	t.Parallel()
	var got []string
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.Host+" "+r.Header.Get("Authorization"))
		_, _ = w.Write([]byte(`{}`))
	}))
	defer ok.Close()
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusUnauthorized)
	}))
	defer refusing.Close()
	a, b := ok.Listener.Addr().String(), refusing.Listener.Addr().String()

	conn, err := esconn.Settings{}.Build("http://u:s3cret@" + a + ", http://" + a + "/")
	require.NoError(t, err)
	require.Equal(t, "http://"+a+",http://"+a+"/", conn.URL)
	require.NoError(t, conn.Probe(context.Background(), nil))
	basic := "Basic " + base64.StdEncoding.EncodeToString([]byte("u:s3cret"))
	require.Equal(t, []string{a + " " + basic, a + " " + basic}, got)

	conn, err = esconn.Settings{}.Build("http://u:s3cret@" + a + ",http://u:s3cret@" + b)
	require.NoError(t, err)
	err = conn.Probe(context.Background(), nil)
	require.Error(t, err)
	require.Contains(t, err.Error(), b)
	require.Contains(t, err.Error(), "401")

	_, err = esconn.Settings{}.Build("http://u:s3cret@" + a + ",http://v:other@" + b)
	require.ErrorContains(t, err, "different user info")
	require.NotContains(t, err.Error(), "s3cret")
	_, err = esconn.Settings{}.Build("http://" + a + ",not-a-url")
	require.ErrorContains(t, err, "ELASTICSEARCH_URL")

	// A client for a list whose first node is down: the request that finds
	// it down fails, the next ones go to the live node.
	down := httptest.NewServer(http.NotFoundHandler())
	downURL := down.URL
	down.Close()
	client, err := index.NewClient(downURL + "," + ok.URL)
	require.NoError(t, err)
	get := func() error {
		_, err := client.PerformRequest(context.Background(), elastic.PerformRequestOptions{Method: http.MethodGet, Path: "/"})
		return err
	}
	require.Error(t, get())
	for range 3 {
		require.NoError(t, get())
	}
}
