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

// docker-compose.secure.yml, laid over docker-compose.yml: every service
// that talks to Kafka or the engine (found from the settings its command
// reads, so a new one cannot be missed) is given settings it reads, reaches
// Kafka on the broker's SASL_SSL listener with a mechanism the broker
// enables, reaches the engine through the TLS proxy, and takes passwords
// from files, never inline; and the plaintext ports are not published to
// the host, so Kafka and the engine cannot be reached around their security
// from outside (PostgreSQL keeps its port: the override does not secure it). Only
// kafka-users, which creates the SCRAM credentials, uses the broker's
// plaintext listener, inside the compose network.
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
	var tree yaml.Node
	require.NoError(t, yaml.Unmarshal(raw, &tree))

	kafkaEnv := merged(base, sec, "kafka")
	require.Contains(t, strings.Split(kafkaEnv["KAFKA_ADVERTISED_LISTENERS"], ","), "SASL_SSL://kafka:9094")
	require.Contains(t, strings.Split(kafkaEnv["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"], ","), "SASL_SSL:SASL_SSL")
	require.Contains(t, sec.Services, "search-proxy")
	require.Contains(t, doc.Configs["nginx_conf"].Content, "listen 9243 ssl")
	require.Contains(t, doc.Configs["nginx_conf"].Content, "proxy_pass http://search:9200")

	// What reaches the host once both files are laid over each other.
	published := map[string][]string{}
	for name := range allServices(base, sec) {
		published[name] = mergedPorts(t, &tree, base, sec, name)
		for _, p := range published[name] {
			container := p[strings.LastIndex(p, ":")+1:]
			require.NotContains(t, []string{"9092", "9200"}, container, "%s publishes the plaintext port %s to the host", name, p)
		}
	}
	require.Equal(t, []string{"9094:9094"}, published["kafka"])
	require.Empty(t, published["search"])
	require.Equal(t, []string{"9243:9243"}, published["search-proxy"])

	var kafkaClients, engineClients []string
	for name, svc := range base.Services {
		if svc.Build == nil {
			continue
		}
		settings := settingsOf(t, svc.Command[0], svc.Command)
		if slices.Contains(settings, "KAFKA_BROKERS") {
			kafkaClients = append(kafkaClients, name)
		}
		if slices.Contains(settings, "ELASTICSEARCH_URL") {
			engineClients = append(engineClients, name)
		}
	}
	slices.Sort(kafkaClients)
	require.Equal(t, []string{"indexer", "publisher", "topics"}, kafkaClients)
	require.Equal(t, []string{"indexer"}, engineClients)

	for _, name := range kafkaClients {
		t.Run(name, func(t *testing.T) {
			svc := base.Services[name]
			env := merged(base, sec, name)
			settings := settingsOf(t, svc.Command[0], svc.Command)
			for k := range sec.Services[name].Environment {
				require.True(t, slices.Contains(settings, k), "%s sets %s, which `%s` does not read", name, k, strings.Join(svc.Command, " "))
			}
			require.Equal(t, "kafka:9094", env["KAFKA_BROKERS"])
			require.Equal(t, "true", env["KAFKA_TLS"])
			require.Equal(t, "/certs/ca.pem", env["KAFKA_TLS_CA_FILE"])
			require.Contains(t, strings.Split(kafkaEnv["KAFKA_SASL_ENABLED_MECHANISMS"], ","), env["KAFKA_SASL_MECHANISM"])
			require.NotEmpty(t, env["KAFKA_SASL_USERNAME"])
			require.Equal(t, "/run/secrets/kafka_password", env["KAFKA_SASL_PASSWORD_FILE"])
			require.Contains(t, sec.Services[name].Secrets, "kafka_password")
			require.Contains(t, sec.Services[name].Volumes, "certs:/certs:ro")
			require.Contains(t, sec.Services[name].DependsOn, "kafka-users", "%s must wait for its SCRAM user", name)
			for _, inline := range []string{"KAFKA_SASL_PASSWORD", "ELASTICSEARCH_PASSWORD", "ELASTICSEARCH_API_KEY"} {
				require.NotContains(t, env, inline, "%s: a password inline; use %s_FILE", name, inline)
			}
			for k, v := range env {
				if strings.HasSuffix(k, "_FILE") {
					require.True(t, strings.HasPrefix(v, "/certs/") || strings.HasPrefix(v, "/run/secrets/"), "%s=%s is not in a mounted volume or secret", k, v)
					if s, ok := strings.CutPrefix(v, "/run/secrets/"); ok {
						require.Contains(t, doc.Secrets, s, "secret %s", s)
						require.Contains(t, sec.Services[name].Secrets, s, "%s does not mount secret %s", name, s)
					}
				}
			}
			if slices.Contains(engineClients, name) {
				u, err := url.Parse(env["ELASTICSEARCH_URL"])
				require.NoError(t, err)
				require.Equal(t, "https", u.Scheme)
				require.Nil(t, u.User, "%s: credentials inline in ELASTICSEARCH_URL", name)
				host, port, err := net.SplitHostPort(u.Host)
				require.NoError(t, err)
				require.Equal(t, "search-proxy", host)
				require.Contains(t, published["search-proxy"], port+":"+port)
				require.Equal(t, "/certs/ca.pem", env["ELASTICSEARCH_CA_FILE"])
				require.NotEmpty(t, env["ELASTICSEARCH_USERNAME"])
				require.Equal(t, "/run/secrets/search_password", env["ELASTICSEARCH_PASSWORD_FILE"])
				require.Contains(t, sec.Services[name].DependsOn, "search-proxy")
			}
		})
	}

	// Nothing but kafka-users (and the broker's own healthcheck, in the base
	// file) names the plaintext listener.
	for name := range allServices(base, sec) {
		if name == "kafka" || name == "kafka-users" {
			continue
		}
		for k, v := range merged(base, sec, name) {
			require.NotContains(t, v, "kafka:9092", "%s %s uses the plaintext listener", name, k)
			require.NotContains(t, v, "search:9200", "%s %s bypasses the TLS proxy", name, k)
		}
	}
	require.Contains(t, strings.Join(sec.Services["kafka-users"].Command, " "), "kafka:9092")
}

func allServices(files ...composeFile) map[string]bool {
	out := map[string]bool{}
	for _, f := range files {
		for name := range f.Services {
			out[name] = true
		}
	}
	return out
}

// mergedPorts is a service's published ports as `docker compose -f base
// -f override` computes them: the override's list is appended to the
// base's, unless it is tagged !override (replaces it) or !reset (clears it).
func mergedPorts(t *testing.T, overrideTree *yaml.Node, base, override composeFile, name string) []string {
	t.Helper()
	tag := ""
	if n := lookup(overrideTree, "services", name, "ports"); n != nil {
		tag = n.Tag
	}
	switch tag {
	case "!reset":
		return nil
	case "!override":
		return override.Services[name].Ports
	case "", "!!seq":
		return append(append([]string(nil), base.Services[name].Ports...), override.Services[name].Ports...)
	default:
		t.Fatalf("%s ports: tag %s", name, tag)
		return nil
	}
}

// lookup follows mapping keys from a document node.
func lookup(n *yaml.Node, keys ...string) *yaml.Node {
	if n.Kind == yaml.DocumentNode && len(n.Content) > 0 {
		n = n.Content[0]
	}
	for _, k := range keys {
		if n.Kind != yaml.MappingNode {
			return nil
		}
		var next *yaml.Node
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == k {
				next = n.Content[i+1]
			}
		}
		if next == nil {
			return nil
		}
		n = next
	}
	return n
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
