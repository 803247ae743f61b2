package e2e

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// No Docker engine runs on the project's machines, so docker-compose.yml is
// kept honest here: its services run commands the binaries have, set only
// settings those commands read, point at the right service names and
// ports, and the Dockerfile builds every binary the file runs.

type composeFile struct {
	Services map[string]composeService `yaml:"services"`
}

type composeService struct {
	Image       string                    `yaml:"image"`
	Build       any                       `yaml:"build"`
	Command     []string                  `yaml:"command"`
	Environment map[string]string         `yaml:"environment"`
	Ports       []string                  `yaml:"ports"`
	DependsOn   map[string]map[string]any `yaml:"depends_on"`
	Healthcheck map[string]any            `yaml:"healthcheck"`
	Volumes     []string                  `yaml:"volumes"`
	Secrets     []composeRef              `yaml:"secrets"`
	Configs     []composeRef              `yaml:"configs"`
	Networks    []string                  `yaml:"networks"`
	User        string                    `yaml:"user"`
	Restart     string                    `yaml:"restart"`
}

// composeRef is a service's secret or config, in the short form (the name)
// or the long one (source, target).
type composeRef struct {
	Source, Target string
}

func (r *composeRef) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		r.Source = n.Value
		return nil
	}
	var long struct {
		Source string `yaml:"source"`
		Target string `yaml:"target"`
	}
	if err := n.Decode(&long); err != nil {
		return err
	}
	r.Source, r.Target = long.Source, long.Target
	return nil
}

// path is where the container sees it: secrets under /run/secrets/,
// configs at /<name>, unless the target is an absolute path.
func (r composeRef) path(dir string) string {
	switch {
	case strings.HasPrefix(r.Target, "/"):
		return r.Target
	case r.Target != "":
		return dir + r.Target
	default:
		return dir + r.Source
	}
}

func loadCompose(t *testing.T, name string) composeFile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(stack.RepoRoot(), name))
	require.NoError(t, err)
	var f composeFile
	require.NoError(t, yaml.Unmarshal(b, &f), name)
	return f
}

var envInHelpRE = regexp.MustCompile(`\(env ([A-Z0-9_]+),`)

// settingsOf runs `<binary> <command...> --help` and returns the environment
// variables the command reads.
func settingsOf(t *testing.T, bin string, command []string) []string {
	t.Helper()
	// The command's words up to the first flag name the sub-command.
	var words []string
	for _, w := range command[1:] {
		if strings.HasPrefix(w, "-") {
			break
		}
		words = append(words, w)
	}
	p := testproc.Run(t, time.Minute, testproc.Build(t, bin), nil, append(words, "--help")...)
	require.Equal(t, 0, p.ExitCode(), "%s %v --help: %s", bin, words, p.Stderr())
	var out []string
	for _, m := range envInHelpRE.FindAllStringSubmatch(p.Stdout(), -1) {
		out = append(out, m[1])
	}
	require.NotEmpty(t, out, "%s %v --help lists no settings:\n%s", bin, words, p.Stdout())
	return out
}

func TestComposeMatchesTheBinaries(t *testing.T) {
	t.Parallel()
	f := loadCompose(t, "docker-compose.yml")
	for _, want := range []string{"postgres", "kafka", "search", "migrate", "seed", "batcher", "publisher", "indexer"} {
		require.Contains(t, f.Services, want, "service %s", want)
	}
	dockerfile, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "Dockerfile"))
	require.NoError(t, err)

	// Infrastructure: the versions the native stack runs, health checks.
	kafkaPom, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "scripts/stack/kafka/pom.xml"))
	require.NoError(t, err)
	kafkaVersion := regexp.MustCompile(`<kafka\.version>([^<]+)</kafka\.version>`).FindSubmatch(kafkaPom)
	require.NotNil(t, kafkaVersion)
	require.Equal(t, "apache/kafka:"+string(kafkaVersion[1]), f.Services["kafka"].Image)
	osScript, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "scripts/stack/opensearch.sh"))
	require.NoError(t, err)
	osVersion := regexp.MustCompile(`OPENSEARCH_VERSION=\$\{OPENSEARCH_VERSION:-([0-9.]+)\}`).FindSubmatch(osScript)
	require.NotNil(t, osVersion)
	require.Equal(t, "opensearchproject/opensearch:"+string(osVersion[1]), f.Services["search"].Image)
	require.Equal(t, "15", strings.TrimPrefix(f.Services["postgres"].Image, "postgres:"))
	for _, infra := range []string{"postgres", "kafka", "search"} {
		require.NotEmpty(t, f.Services[infra].Healthcheck, "%s health check", infra)
	}
	require.Equal(t, "single-node", f.Services["search"].Environment["discovery.type"])
	require.Equal(t, "PLAINTEXT://kafka:9092", f.Services["kafka"].Environment["KAFKA_ADVERTISED_LISTENERS"])
	require.Equal(t, "broker,controller", f.Services["kafka"].Environment["KAFKA_PROCESS_ROLES"])

	listening := map[string]string{"postgres": "5432", "kafka": "9092", "search": "9200"}
	for name, svc := range f.Services {
		if svc.Build == nil {
			continue
		}
		t.Run(name, func(t *testing.T) {
			require.NotEmpty(t, svc.Command, "command")
			bin := svc.Command[0]
			require.Contains(t, []string{"batcher", "publisher", "indexer"}, bin)
			require.Contains(t, string(dockerfile), "./cmd/"+bin, "the Dockerfile builds %s", bin)
			require.Contains(t, string(dockerfile), "/out/"+bin, "the Dockerfile copies %s", bin)

			settings := settingsOf(t, bin, svc.Command)
			for env, val := range svc.Environment {
				require.True(t, slices.Contains(settings, env), "%s sets %s, which `%s` does not read (it reads %v)", name, env, strings.Join(svc.Command, " "), settings)
				switch env {
				case "DATABASE_URL", "ELASTICSEARCH_URL":
					u, err := url.Parse(val)
					require.NoError(t, err)
					host, port, err := net.SplitHostPort(u.Host)
					require.NoError(t, err)
					require.Equal(t, listening[host], port, "%s %s points at %s", name, env, u.Host)
					require.Contains(t, svc.DependsOn, host, "%s uses %s but does not depend on it", name, host)
				case "KAFKA_BROKERS":
					for _, b := range strings.Split(val, ",") {
						host, port, err := net.SplitHostPort(b)
						require.NoError(t, err)
						require.Equal(t, listening[host], port)
						require.Contains(t, svc.DependsOn, host)
					}
				case "METRICS_ADDR":
					host, port, err := net.SplitHostPort(val)
					require.NoError(t, err)
					require.Equal(t, "0.0.0.0", host, "%s METRICS_ADDR: the binaries bind loopback by default, so compose must open it on purpose", name)
					require.Contains(t, svc.Ports, fmt.Sprintf("%s:%s", port, port), "%s publishes its metrics port", name)
				}
			}
			if slices.Contains(settings, "METRICS_ADDR") {
				require.Contains(t, svc.Environment, "METRICS_ADDR", "%s: without it the metrics bind the container's loopback", name)
			}
			for _, required := range requiredSettings[bin] {
				if slices.Contains(settings, required) {
					require.Contains(t, svc.Environment, required, "%s must set %s", name, required)
				}
			}
			_, dependsOnDB := svc.DependsOn["postgres"]
			_, dependsOnMigrate := svc.DependsOn["migrate"]
			_, dependsOnSeed := svc.DependsOn["seed"]
			if _, usesDB := svc.Environment["DATABASE_URL"]; usesDB {
				require.True(t, dependsOnDB || dependsOnMigrate || dependsOnSeed, "%s uses PostgreSQL before it is ready", name)
			}
		})
	}

	// Prometheus scrapes each service where compose opens its metrics, with
	// the job names the alert rules expect, and loads the rules.
	prom := f.Services["prometheus"]
	require.Contains(t, prom.Volumes, "./deploy/prometheus:/etc/prometheus:ro")
	b, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "deploy/prometheus/prometheus.yml"))
	require.NoError(t, err)
	var promCfg struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	require.NoError(t, yaml.Unmarshal(b, &promCfg))
	require.Equal(t, []string{"alerts.yml"}, promCfg.RuleFiles)
	scraped := map[string][]string{}
	for _, sc := range promCfg.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			scraped[sc.JobName] = append(scraped[sc.JobName], st.Targets...)
		}
	}
	want := map[string][]string{}
	for _, svc := range []string{"batcher", "publisher", "indexer"} {
		_, port, err := net.SplitHostPort(f.Services[svc].Environment["METRICS_ADDR"])
		require.NoError(t, err)
		want[svc] = []string{svc + ":" + port}
	}
	require.Equal(t, want, scraped)

	es := loadCompose(t, "docker-compose.elasticsearch.yml")
	require.Contains(t, es.Services, "search")
	require.True(t, strings.HasPrefix(es.Services["search"].Image, "docker.elastic.co/elasticsearch/elasticsearch:7.17."), es.Services["search"].Image)
}

// requiredSettings are the settings without which a command cannot run.
var requiredSettings = map[string][]string{
	"batcher":   {"DATABASE_URL"},
	"publisher": {"DATABASE_URL", "KAFKA_BROKERS"},
	"indexer":   {"KAFKA_BROKERS", "ELASTICSEARCH_URL"},
}
