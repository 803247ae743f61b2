package esconn_test

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/esconn"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// A comma in the password of ELASTICSEARCH_URL is part of the password, not
// a separator between nodes: the engine gets the whole password and no part
// of it is printed.
func TestBuildCommaInPassword(t *testing.T) {
	t.Parallel()
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.Header.Get("Authorization"))
		_, _ = w.Write([]byte(`{}`))
	}))
	defer srv.Close()
	a := srv.Listener.Addr().String()
	conn, err := esconn.Settings{}.Build("http://u:pa,ss@" + a + ", http://u:pa,ss@" + a + "/")
	require.NoError(t, err)
	require.Equal(t, "http://"+a+",http://"+a+"/", conn.URL)
	require.NoError(t, conn.Probe(context.Background(), nil))
	basic := "Basic " + base64.StdEncoding.EncodeToString([]byte("u:pa,ss"))
	require.Equal(t, []string{basic, basic}, got)
}

// A password with an unescaped '#', '?' or '/' makes url.Parse read the
// user as a host and the rest as a fragment, query or path: refused with
// one line naming ELASTICSEARCH_URL that shows no part of the password
// (before, the URL was kept and the probe logged it twice).
func TestBuildRefusesMisreadUserInfo(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{
		"https://u:12#s3cret@h:9200",
		"https://u:#s3cret@h:9200",
		"https://u:12?s3cret@h:9200",
		"https://u:12/s3cret@h:9200",
		"https://h1:9200,https://u:12#s3cret@h2:9200",
	} {
		_, err := esconn.Settings{}.Build(raw)
		require.Error(t, err, raw)
		require.Contains(t, err.Error(), "ELASTICSEARCH_URL", raw)
		require.Contains(t, err.Error(), "percent-encode", raw)
		require.NotContains(t, err.Error(), "s3cret", raw)
	}
}

// Secrets given to Build directly are registered too, so a log line or an
// error quoting them is masked.
func TestBuildRegistersSecrets(t *testing.T) {
	t.Parallel()
	_, err := esconn.Settings{Username: "u", Password: "direct-es-pw"}.Build("https://h:9200")
	require.NoError(t, err)
	_, err = esconn.Settings{APIKey: "kid:direct-es-key"}.Build("https://h:9200")
	require.NoError(t, err)
	enc := base64.StdEncoding.EncodeToString([]byte("kid:direct-es-key"))
	require.Equal(t, "a xxxxx b xxxxx c xxxxx", redact.String("a direct-es-pw b kid:direct-es-key c "+enc))
}
