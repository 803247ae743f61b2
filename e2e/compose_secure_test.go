package e2e

import (
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// docker-compose.secure.yml, laid over docker-compose.yml: the services
// read every setting it gives them, reach Kafka on the broker's SASL_SSL
// listener with a mechanism the broker enables, reach the engine through
// the TLS proxy, and take passwords from files, never inline.
func TestComposeSecureOverride(t *testing.T) {
	t.Parallel()
	base := loadCompose(t, "docker-compose.yml")
	sec := loadCompose(t, "docker-compose.secure.yml")
	raw, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "docker-compose.secure.yml"))
	require.NoError(t, err)
	var doc struct {
		Configs map[string]struct {
			Content string `yaml:"content"`
		} `yaml:"configs"`
		Secrets map[string]any `yaml:"secrets"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &doc))

	kafkaEnv := merged(base, sec, "kafka")
	require.Contains(t, strings.Split(kafkaEnv["KAFKA_ADVERTISED_LISTENERS"], ","), "SASL_SSL://kafka:9094")
	require.Contains(t, strings.Split(kafkaEnv["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"], ","), "SASL_SSL:SASL_SSL")
	require.Contains(t, sec.Services["kafka"].Ports, "9094:9094")
	require.Contains(t, sec.Services, "search-proxy")
	require.Contains(t, doc.Configs["nginx_conf"].Content, "listen 9243 ssl")
	require.Contains(t, doc.Configs["nginx_conf"].Content, "proxy_pass http://search:9200")

	for _, name := range []string{"publisher", "indexer"} {
		t.Run(name, func(t *testing.T) {
			svc := base.Services[name]
			env := merged(base, sec, name)
			settings := settingsOf(t, svc.Command[0], svc.Command)
			for k := range sec.Services[name].Environment {
				require.True(t, slices.Contains(settings, k), "%s sets %s, which `%s` does not read", name, k, strings.Join(svc.Command, " "))
			}
			require.Equal(t, "kafka:9094", env["KAFKA_BROKERS"])
			require.Equal(t, "true", env["KAFKA_TLS"])
			require.Contains(t, strings.Split(kafkaEnv["KAFKA_SASL_ENABLED_MECHANISMS"], ","), env["KAFKA_SASL_MECHANISM"])
			for _, inline := range []string{"KAFKA_SASL_PASSWORD", "ELASTICSEARCH_PASSWORD", "ELASTICSEARCH_API_KEY"} {
				require.NotContains(t, env, inline, "%s: a password inline; use %s_FILE", name, inline)
			}
			for k, v := range env {
				if strings.HasSuffix(k, "_FILE") {
					require.True(t, strings.HasPrefix(v, "/certs/") || strings.HasPrefix(v, "/run/secrets/"), "%s=%s is not in a mounted volume or secret", k, v)
					if s, ok := strings.CutPrefix(v, "/run/secrets/"); ok {
						require.Contains(t, doc.Secrets, s, "secret %s", s)
					}
				}
			}
			if name == "indexer" {
				u, err := url.Parse(env["ELASTICSEARCH_URL"])
				require.NoError(t, err)
				require.Equal(t, "https", u.Scheme)
				host, port, err := net.SplitHostPort(u.Host)
				require.NoError(t, err)
				require.Equal(t, "search-proxy", host)
				require.Contains(t, sec.Services["search-proxy"].Ports, port+":"+port)
				require.Contains(t, sec.Services[name].DependsOn, "search-proxy")
			}
		})
	}
}

// merged is a service's environment with the override's entries on top, as
// `docker compose -f base -f override` computes it.
func merged(base, override composeFile, name string) map[string]string {
	env := map[string]string{}
	for k, v := range base.Services[name].Environment {
		env[k] = v
	}
	for k, v := range override.Services[name].Environment {
		env[k] = v
	}
	return env
}
