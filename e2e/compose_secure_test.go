package e2e

import (
	"bufio"
	"cmp"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// docker-compose.secure.yml, laid over docker-compose.yml, is checked here
// the way a security reviewer reads it (no Docker engine runs on the
// project's machines): the CA's key stays in the one-shot job that issues
// the certificates; every private key and password file a server reads is
// owned by the uid its image runs as and readable by it only; nothing
// plaintext can be reached (Kafka SASL_SSL only, the engine behind the TLS
// proxy on a network of their own, PostgreSQL hostssl + SCRAM with clients
// on verify-full); no database or metrics port is published and the
// metrics need auth; passwords come from Compose secrets files made by
// scripts/compose-secrets.sh, never from the YAML.

// secureCompose is both files and the override's raw document.
type secureCompose struct {
	base, sec composeFile
	tree      yaml.Node
	doc       struct {
		Configs map[string]struct {
			Content     string `yaml:"content"`
			File        string `yaml:"file"`
			Environment string `yaml:"environment"`
		} `yaml:"configs"`
		Secrets map[string]struct {
			File        string `yaml:"file"`
			Environment string `yaml:"environment"`
		} `yaml:"secrets"`
		Networks map[string]struct {
			Internal bool `yaml:"internal"`
		} `yaml:"networks"`
		Volumes map[string]any `yaml:"volumes"`
	}
}

func loadSecureCompose(t *testing.T) *secureCompose {
	t.Helper()
	c := &secureCompose{base: loadCompose(t, "docker-compose.yml"), sec: loadCompose(t, "docker-compose.secure.yml")}
	raw, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "docker-compose.secure.yml"))
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(raw, &c.doc))
	require.NoError(t, yaml.Unmarshal(raw, &c.tree))
	return c
}

// env is a service's environment as `docker compose -f base -f override`
// computes it: the override's entries on top of the base's, or the
// override's alone when tagged !override.
func (c *secureCompose) env(name string) map[string]string {
	env := map[string]string{}
	if n := lookup(&c.tree, "services", name, "environment"); n == nil || n.Tag != "!override" {
		for k, v := range c.base.Services[name].Environment {
			env[k] = v
		}
	}
	for k, v := range c.sec.Services[name].Environment {
		env[k] = v
	}
	return env
}

func (c *secureCompose) command(name string) []string {
	if cmd := c.sec.Services[name].Command; cmd != nil {
		return cmd
	}
	return c.base.Services[name].Command
}

func (c *secureCompose) volumes(name string) []string {
	return append(append([]string(nil), c.base.Services[name].Volumes...), c.sec.Services[name].Volumes...)
}

func (c *secureCompose) secrets(name string) []composeRef {
	return append(append([]composeRef(nil), c.base.Services[name].Secrets...), c.sec.Services[name].Secrets...)
}

func (c *secureCompose) networks(name string) []string {
	if n := c.sec.Services[name].Networks; n != nil {
		return n
	}
	if n := c.base.Services[name].Networks; n != nil {
		return n
	}
	return []string{"default"}
}

func (c *secureCompose) healthcheck(name string) string {
	if h := c.sec.Services[name].Healthcheck; h != nil {
		return fmt.Sprint(h["test"])
	}
	return fmt.Sprint(c.base.Services[name].Healthcheck["test"])
}

// secretAt returns the secret mounted at p in service name ("" if none).
func (c *secureCompose) secretAt(name, p string) string {
	for _, s := range c.secrets(name) {
		if s.path("/run/secrets/") == p {
			return s.Source
		}
	}
	return ""
}

// mountOf returns the named volume mounted at p's directory (or above) in
// service name, the path inside that volume, and whether it is read-only.
func (c *secureCompose) mountOf(name, p string) (volume, rel string, ro bool) {
	best := ""
	for _, v := range c.volumes(name) {
		parts := strings.Split(v, ":")
		if len(parts) < 2 || strings.HasPrefix(parts[0], ".") || strings.HasPrefix(parts[0], "/") {
			continue
		}
		target := strings.TrimSuffix(parts[1], "/")
		if strings.HasPrefix(p, target+"/") && len(target) > len(best) {
			best, volume, rel = target, parts[0], strings.TrimPrefix(p, target+"/")
			ro = len(parts) == 3 && parts[2] == "ro"
		}
	}
	return volume, rel, ro
}

// certsJob is the one-shot job's script, split into commands, and where it
// mounts each volume.
type certsJob struct {
	script string
	lines  [][]string
	mounts map[string]string // volume → path in the job
}

func (c *secureCompose) certsJob(t *testing.T) certsJob {
	t.Helper()
	cmd := c.sec.Services["certs"].Command
	require.Len(t, cmd, 3, "certs: [sh, -ec, script]")
	// Compose turns $$ into $ before the shell sees it.
	j := certsJob{script: strings.ReplaceAll(cmd[2], "$$", "$"), mounts: map[string]string{}}
	sc := bufio.NewScanner(strings.NewReader(j.script))
	for sc.Scan() {
		line := sc.Text()
		if i := strings.Index(line, "#"); i >= 0 {
			line = line[:i]
		}
		if f := strings.Fields(line); len(f) > 0 {
			j.lines = append(j.lines, f)
		}
	}
	for _, v := range c.sec.Services["certs"].Volumes {
		parts := strings.Split(v, ":")
		require.GreaterOrEqual(t, len(parts), 2, v)
		j.mounts[parts[0]] = parts[1]
	}
	return j
}

// owner returns the uid:gid the job's chown lines give p (directly or
// through chown -R of a directory above it).
func (j certsJob) owner(p string) string {
	owner := ""
	for _, f := range j.lines {
		if f[0] != "chown" {
			continue
		}
		args, recursive := f[1:], false
		if len(args) > 0 && args[0] == "-R" {
			args, recursive = args[1:], true
		}
		if len(args) < 2 {
			continue
		}
		for _, a := range args[1:] {
			if a == p || recursive && strings.HasPrefix(p, strings.TrimSuffix(a, "/")+"/") {
				owner = args[0]
			}
		}
	}
	return owner
}

// modes returns every mode the job's chmod lines give p (by name or glob).
func (j certsJob) modes(p string) []string {
	var out []string
	for _, f := range j.lines {
		if f[0] != "chmod" || len(f) < 3 {
			continue
		}
		args := f[1:]
		if args[0] == "-R" {
			args = args[1:]
		}
		for _, a := range args[1:] {
			if ok, _ := path.Match(a, p); ok || a == p || strings.HasPrefix(p, strings.TrimSuffix(a, "/")+"/") && f[1] == "-R" {
				out = append(out, args[0])
			}
		}
	}
	return out
}

// serviceUIDs are the users the servers' images run as, which must own the
// files they read: apache/kafka runs as appuser (uid 1000); postgres:15
// runs the server as postgres (uid 999, gid 999); nginx's master process
// reads the key as root before it starts the workers.
var serviceUIDs = map[string]string{
	"apache/kafka:": "1000:1000",
	"postgres:":     "999:999",
	"nginx:":        "0:0",
}

func (c *secureCompose) uidOf(t *testing.T, name string) string {
	t.Helper()
	image := cmp.Or(c.sec.Services[name].Image, c.base.Services[name].Image)
	require.Empty(t, c.sec.Services[name].User, "%s: runs as the image's user", name)
	for prefix, uid := range serviceUIDs {
		if strings.HasPrefix(image, prefix) {
			return uid
		}
	}
	t.Fatalf("%s: no known uid for image %q", name, image)
	return ""
}

// requirePrivate checks that the file service name reads at p comes from a
// volume the job fills, mounted read-only, and that the job makes it owned
// by the service's uid and readable by it alone.
func (c *secureCompose) requirePrivate(t *testing.T, j certsJob, name, p string) {
	t.Helper()
	vol, rel, ro := c.mountOf(name, p)
	require.NotEmpty(t, vol, "%s reads %s, which is on no named volume", name, p)
	require.True(t, ro, "%s mounts %s read-write", name, vol)
	jobDir, ok := j.mounts[vol]
	require.True(t, ok, "%s: the volume %s is not filled by the certs job", name, vol)
	jp := jobDir + "/" + rel
	require.Contains(t, j.script, jp, "%s reads %s (%s in the certs job), which the job does not write", name, p, jp)
	require.Equal(t, c.uidOf(t, name), j.owner(jp), "%s: %s (%s in the certs job) must be owned by the uid %s runs as", name, p, jp, name)
	modes := j.modes(jp)
	require.NotEmpty(t, modes, "%s: the certs job sets no mode on %s", name, jp)
	for _, m := range modes {
		require.Contains(t, []string{"400", "0400", "600", "0600"}, m, "%s: %s is given mode %s", name, jp, m)
	}
}

func TestComposeSecureCertificates(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	j := c.certsJob(t)
	require.Equal(t, "no", c.sec.Services["certs"].Restart)

	// The CA's key: in a volume the job alone mounts, readable by root only.
	m := regexp.MustCompile(`-CAkey\s+(\S+)`).FindStringSubmatch(j.script)
	require.NotNil(t, m, "the certs job signs with -CAkey")
	caKey := m[1]
	caVolume := ""
	for vol, dir := range j.mounts {
		if strings.HasPrefix(caKey, dir+"/") {
			caVolume = vol
		}
	}
	require.NotEmpty(t, caVolume, "the CA key %s is on no volume of the certs job", caKey)
	require.Equal(t, []string{"0400"}, j.modes(caKey), "the CA key's mode")
	for name := range allServices(c.base, c.sec) {
		if name == "certs" {
			continue
		}
		for _, v := range c.volumes(name) {
			require.NotEqual(t, caVolume, strings.Split(v, ":")[0], "%s mounts %s, the volume holding the CA's key", name, caVolume)
		}
	}

	// Each volume the job fills is mounted read-only, and by one service
	// unless it holds the CA certificate alone.
	for vol, dir := range j.mounts {
		if vol == caVolume {
			continue
		}
		var users []string
		for name := range allServices(c.base, c.sec) {
			for _, v := range c.volumes(name) {
				if parts := strings.Split(v, ":"); parts[0] == vol && name != "certs" {
					require.Equal(t, "ro", parts[len(parts)-1], "%s mounts %s read-write", name, vol)
					users = append(users, name)
				}
			}
		}
		require.NotEmpty(t, users, "nobody mounts %s", vol)
		if len(users) > 1 {
			for _, w := range regexp.MustCompile(regexp.QuoteMeta(dir)+`(/[^\s;"']*)?`).FindAllString(j.script, -1) {
				require.Equal(t, dir+"/ca.pem", w, "%s is shared by %v: the job may write the CA certificate to it, nothing else", vol, users)
			}
		}
	}

	// What each server reads that is private.
	pgCmd := strings.Join(c.command("postgres"), " ")
	m = regexp.MustCompile(`ssl_key_file=(\S+)`).FindStringSubmatch(pgCmd)
	require.NotNil(t, m, "postgres: ssl_key_file")
	c.requirePrivate(t, j, "postgres", m[1])

	m = regexp.MustCompile(`ssl_certificate_key\s+([^;\s]+);`).FindStringSubmatch(c.doc.Configs["nginx_conf"].Content)
	require.NotNil(t, m, "nginx_conf: ssl_certificate_key")
	c.requirePrivate(t, j, "search-proxy", m[1])

	kafkaEnv := c.env("kafka")
	for _, k := range []string{"KAFKA_SSL_KEYSTORE_FILENAME", "KAFKA_SSL_KEYSTORE_CREDENTIALS", "KAFKA_SSL_KEY_CREDENTIALS"} {
		require.NotEmpty(t, kafkaEnv[k], "kafka: %s (the image reads it under /etc/kafka/secrets)", k)
		c.requirePrivate(t, j, "kafka", "/etc/kafka/secrets/"+kafkaEnv[k])
	}
	m = regexp.MustCompile(`java\.security\.auth\.login\.config=(\S+)`).FindStringSubmatch(kafkaEnv["KAFKA_OPTS"])
	require.NotNil(t, m, "kafka: KAFKA_OPTS names the JAAS file")
	c.requirePrivate(t, j, "kafka", m[1])
	configRE := regexp.MustCompile(`--command-config\s+(\S+)`)
	m = configRE.FindStringSubmatch(c.healthcheck("kafka"))
	require.NotNil(t, m, "kafka's health check authenticates with --command-config")
	c.requirePrivate(t, j, "kafka", m[1])
	m = configRE.FindStringSubmatch(strings.Join(c.command("kafka-users"), " "))
	require.NotNil(t, m, "kafka-users authenticates with --command-config")
	c.requirePrivate(t, j, "kafka-users", m[1])

	// No chmod in the job opens anything to group or others but
	// certificates.
	for _, f := range j.lines {
		if f[0] != "chmod" || len(f) < 3 {
			continue
		}
		mode, err := strconv.ParseUint(strings.TrimPrefix(f[1], "-R"), 8, 32)
		if err != nil {
			continue
		}
		if mode&0o077 != 0 {
			for _, a := range f[2:] {
				require.True(t, strings.HasSuffix(a, ".pem"), "chmod %s %s opens more than certificates", f[1], a)
			}
		}
	}
	require.NotContains(t, j.script, "chmod 644 /", "no blanket chmod")
}

// listeners parses Kafka's NAME://host:port lists.
func listeners(t *testing.T, s string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, l := range strings.Split(s, ",") {
		name, hostPort, ok := strings.Cut(l, "://")
		require.True(t, ok, "listener %q", l)
		out[name] = hostPort
	}
	return out
}

func TestComposeSecureKafka(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	env := c.env("kafka")
	protocols := map[string]string{}
	for _, p := range strings.Split(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"], ",") {
		name, proto, ok := strings.Cut(p, ":")
		require.True(t, ok, p)
		protocols[name] = proto
	}
	controllers := strings.Split(env["KAFKA_CONTROLLER_LISTENER_NAMES"], ",")
	loopback := []string{"localhost", "127.0.0.1"}
	for name, hostPort := range listeners(t, env["KAFKA_LISTENERS"]) {
		host, _, err := net.SplitHostPort(hostPort)
		require.NoError(t, err)
		if slices.Contains(controllers, name) {
			require.Contains(t, loopback, host, "the controller listener %s must listen on the broker's loopback only", name)
			continue
		}
		require.Equal(t, "SASL_SSL", protocols[name], "listener %s://%s is %s", name, hostPort, protocols[name])
	}
	for name := range listeners(t, env["KAFKA_ADVERTISED_LISTENERS"]) {
		require.Equal(t, "SASL_SSL", protocols[name], "advertised listener %s", name)
	}
	require.Equal(t, map[string]string{"SASL_SSL": "kafka:9094"}, listeners(t, env["KAFKA_ADVERTISED_LISTENERS"]))
	require.Equal(t, "SASL_SSL", protocols[env["KAFKA_INTER_BROKER_LISTENER_NAME"]], "the inter-broker listener")
	for _, v := range strings.Split(env["KAFKA_CONTROLLER_QUORUM_VOTERS"], ",") {
		_, hostPort, _ := strings.Cut(v, "@")
		host, _, err := net.SplitHostPort(hostPort)
		require.NoError(t, err)
		require.Contains(t, loopback, host, "quorum voter %s", v)
	}
	require.NotContains(t, c.healthcheck("kafka"), ":9092", "kafka's health check uses a plaintext listener")
	require.Contains(t, c.healthcheck("kafka"), "kafka:9094")
	users := strings.Join(c.command("kafka-users"), " ")
	require.Contains(t, users, "--bootstrap-server kafka:9094")
	require.NotContains(t, users, "[password=", "kafka-users puts the password on kafka-configs' command line")

	// Nothing names the plaintext listener, or the engine's port but the proxy.
	for name := range allServices(c.base, c.sec) {
		texts := []string{strings.Join(c.command(name), " "), c.healthcheck(name)}
		for _, v := range c.env(name) {
			texts = append(texts, v)
		}
		for _, v := range texts {
			require.NotContains(t, v, "kafka:9092", "%s uses the plaintext listener", name)
			if name != "search" {
				require.NotContains(t, v, "search:9200", "%s bypasses the TLS proxy", name)
			}
		}
	}
}

func TestComposeSecureSearchBehindTheProxy(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	nets := c.networks("search")
	require.Len(t, nets, 1, "search joins one network")
	require.True(t, c.doc.Networks[nets[0]].Internal, "the engine's network %s must be internal", nets[0])
	var members []string
	for name := range allServices(c.base, c.sec) {
		if slices.Contains(c.networks(name), nets[0]) {
			members = append(members, name)
		}
	}
	slices.Sort(members)
	require.Equal(t, []string{"search", "search-proxy"}, members, "only the proxy reaches the engine")

	conf := c.doc.Configs["nginx_conf"].Content
	require.Contains(t, conf, "listen 9243 ssl;")
	require.Contains(t, conf, "proxy_pass http://search:9200;")
	require.Contains(t, conf, `proxy_set_header Authorization "";`)
	m := regexp.MustCompile(`auth_basic_user_file\s+([^;\s]+);`).FindStringSubmatch(conf)
	require.NotNil(t, m, "nginx_conf: auth_basic_user_file")
	require.NotEmpty(t, c.secretAt("search-proxy", m[1]), "the htpasswd file %s is not a secret of search-proxy", m[1])
}

func TestComposeSecurePostgres(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	cmd := c.command("postgres")
	settings := map[string]string{}
	for i := 0; i+1 < len(cmd); i++ {
		if cmd[i] == "-c" {
			k, v, _ := strings.Cut(cmd[i+1], "=")
			settings[k] = v
		}
	}
	require.NotEmpty(t, cmd, "postgres: no command, so no TLS or SCRAM settings")
	require.Equal(t, "postgres", cmd[0])
	require.Equal(t, "on", settings["ssl"])
	require.Equal(t, "scram-sha-256", settings["password_encryption"])
	hba := settings["hba_file"]
	require.NotEmpty(t, hba, "postgres: -c hba_file=")
	var hbaConf string
	for _, cf := range c.sec.Services["postgres"].Configs {
		if cf.path("/") == hba {
			hbaConf = c.doc.Configs[cf.Source].Content
		}
	}
	require.NotEmpty(t, hbaConf, "%s is not a config of postgres", hba)
	hostssl := 0
	for _, line := range strings.Split(hbaConf, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		require.Contains(t, []string{"local", "hostssl"}, f[0], "pg_hba: %q lets a client in without TLS", line)
		require.Equal(t, "scram-sha-256", f[len(f)-1], "pg_hba: %q", line)
		if f[0] == "hostssl" {
			hostssl++
		}
	}
	require.Positive(t, hostssl, "pg_hba lets no one in over TCP")

	env := c.env("postgres")
	require.NotContains(t, env, "POSTGRES_PASSWORD")
	require.NotEmpty(t, c.secretAt("postgres", env["POSTGRES_PASSWORD_FILE"]), "POSTGRES_PASSWORD_FILE=%s is not a secret", env["POSTGRES_PASSWORD_FILE"])

	// Every client: TLS verifying the server's name against the compose CA,
	// the password from a pgpass secret.
	var clients []string
	for name := range allServices(c.base, c.sec) {
		dbURL, ok := c.env(name)["DATABASE_URL"]
		if !ok {
			continue
		}
		clients = append(clients, name)
		u, err := url.Parse(dbURL)
		require.NoError(t, err, name)
		_, hasPassword := u.User.Password()
		require.False(t, hasPassword, "%s: a password in DATABASE_URL", name)
		require.Equal(t, "postgres", u.Hostname(), name)
		q := u.Query()
		require.Equal(t, "verify-full", q.Get("sslmode"), "%s DATABASE_URL", name)
		vol, rel, ro := c.mountOf(name, q.Get("sslrootcert"))
		require.True(t, ro && rel == "ca.pem", "%s: sslrootcert=%s is not the CA certificate on a read-only volume", name, q.Get("sslrootcert"))
		require.Contains(t, c.certsJob(t).mounts, vol, "%s: %s is not filled by the certs job", name, vol)
		require.NotEmpty(t, c.secretAt(name, q.Get("passfile")), "%s: passfile=%s is not a secret", name, q.Get("passfile"))
	}
	slices.Sort(clients)
	require.Equal(t, []string{"batcher", "migrate", "publisher", "seed"}, clients)
}

// TestComposeSecurePorts: once both files are laid over each other, only
// the TLS endpoints with auth reach the host.
func TestComposeSecurePorts(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	published := map[string][]string{}
	for name := range allServices(c.base, c.sec) {
		if p := mergedPorts(t, &c.tree, c.base, c.sec, name); len(p) > 0 {
			published[name] = p
		}
	}
	require.Equal(t, map[string][]string{"kafka": {"9094:9094"}, "search-proxy": {"9243:9243"}}, published)
}

// secretLike is an environment variable that would hold a secret inline
// (the Kafka image's *_CREDENTIALS name files under /etc/kafka/secrets).
var secretLike = regexp.MustCompile(`(PASSWORD|SECRET|API_KEY|TOKEN)$`)

// TestComposeSecureSecretsAndSettings: every service that talks to Kafka,
// the engine or PostgreSQL (found from the settings its command reads, so
// a new one cannot be missed) sets only settings it reads, takes each
// password from a Compose secret through a *_FILE setting, and reaches
// Kafka and the engine over TLS with auth; the metrics need auth and
// Prometheus scrapes with it; no secret is in the YAML.
func TestComposeSecureSecretsAndSettings(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	for name, s := range c.doc.Secrets {
		require.Empty(t, s.Environment, "secret %s from an environment variable: use a file", name)
		require.True(t, strings.HasPrefix(s.File, "./secrets/"), "secret %s: file %q, want ./secrets/ (scripts/compose-secrets.sh)", name, s.File)
	}
	for name, cf := range c.doc.Configs {
		require.Empty(t, cf.Environment, "config %s from an environment variable", name)
		require.NotRegexp(t, `(?i)password\s*=`, cf.Content, "config %s holds a password", name)
	}
	for name := range allServices(c.base, c.sec) {
		for k, v := range c.env(name) {
			require.False(t, secretLike.MatchString(k), "%s: %s=%q inline; use %s_FILE and a secret", name, k, v, k)
			require.NotRegexp(t, `(?i)password\s*=`, v, "%s: %s holds a password", name, k)
			if u, err := url.Parse(v); err == nil && u.User != nil {
				_, has := u.User.Password()
				require.False(t, has, "%s: %s holds a password", name, k)
			}
		}
	}

	kafkaEnv := c.env("kafka")
	var kafkaClients, engineClients, metrics []string
	for name, svc := range c.base.Services {
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
		if slices.Contains(settings, "METRICS_ADDR") {
			metrics = append(metrics, name)
		}
		t.Run(name, func(t *testing.T) {
			env := c.env(name)
			for k, v := range env {
				require.True(t, slices.Contains(settings, k), "%s sets %s, which `%s` does not read (it reads %v)", name, k, strings.Join(svc.Command, " "), settings)
				if !strings.HasSuffix(k, "_FILE") {
					continue
				}
				if secret := c.secretAt(name, v); secret != "" {
					require.Contains(t, c.doc.Secrets, secret)
					continue
				}
				vol, _, ro := c.mountOf(name, v)
				require.True(t, vol != "" && ro, "%s: %s=%s is neither a secret nor on a read-only volume", name, k, v)
			}
			if slices.Contains(settings, "KAFKA_BROKERS") {
				require.Equal(t, "kafka:9094", env["KAFKA_BROKERS"])
				require.Equal(t, "true", env["KAFKA_TLS"])
				require.NotEmpty(t, env["KAFKA_TLS_CA_FILE"])
				require.Contains(t, strings.Split(kafkaEnv["KAFKA_SASL_ENABLED_MECHANISMS"], ","), env["KAFKA_SASL_MECHANISM"])
				require.True(t, strings.HasPrefix(env["KAFKA_SASL_MECHANISM"], "SCRAM-"), "%s: SASL %s", name, env["KAFKA_SASL_MECHANISM"])
				require.NotEmpty(t, env["KAFKA_SASL_USERNAME"])
				require.NotEmpty(t, c.secretAt(name, env["KAFKA_SASL_PASSWORD_FILE"]), "%s: KAFKA_SASL_PASSWORD_FILE", name)
				require.Contains(t, c.sec.Services[name].DependsOn, "kafka-users", "%s must wait for its SCRAM user", name)
			}
			if slices.Contains(settings, "ELASTICSEARCH_URL") {
				u, err := url.Parse(env["ELASTICSEARCH_URL"])
				require.NoError(t, err)
				require.Equal(t, "https", u.Scheme)
				require.Equal(t, "search-proxy:9243", u.Host)
				require.NotEmpty(t, env["ELASTICSEARCH_CA_FILE"])
				require.NotEmpty(t, env["ELASTICSEARCH_USERNAME"])
				require.NotEmpty(t, c.secretAt(name, env["ELASTICSEARCH_PASSWORD_FILE"]), "%s: ELASTICSEARCH_PASSWORD_FILE", name)
				require.Contains(t, c.sec.Services[name].DependsOn, "search-proxy")
			}
			if slices.Contains(settings, "METRICS_ADDR") {
				require.NotEmpty(t, env["METRICS_USERNAME"], "%s: metrics without auth", name)
				require.Equal(t, "metrics_password", c.secretAt(name, env["METRICS_PASSWORD_FILE"]), "%s: METRICS_PASSWORD_FILE", name)
			}
		})
	}
	slices.Sort(kafkaClients)
	slices.Sort(metrics)
	require.Equal(t, []string{"indexer", "publisher", "topics"}, kafkaClients)
	require.Equal(t, []string{"indexer"}, engineClients)
	require.Equal(t, []string{"batcher", "indexer", "publisher"}, metrics)

	// Prometheus scrapes each service with its metrics user and password.
	cmd := strings.Join(c.command("prometheus"), " ")
	m := regexp.MustCompile(`--config\.file=/etc/prometheus/(\S+)`).FindStringSubmatch(cmd)
	require.NotNil(t, m, "prometheus: --config.file")
	require.Contains(t, c.volumes("prometheus"), "./deploy/prometheus:/etc/prometheus:ro")
	b, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "deploy/prometheus", m[1]))
	require.NoError(t, err)
	var promCfg struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName   string `yaml:"job_name"`
			BasicAuth struct {
				Username     string `yaml:"username"`
				PasswordFile string `yaml:"password_file"`
			} `yaml:"basic_auth"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	require.NoError(t, yaml.Unmarshal(b, &promCfg))
	require.Equal(t, []string{"alerts.yml"}, promCfg.RuleFiles)
	scraped := map[string][]string{}
	for _, sc := range promCfg.ScrapeConfigs {
		env := c.env(sc.JobName)
		require.Equal(t, env["METRICS_USERNAME"], sc.BasicAuth.Username, "job %s", sc.JobName)
		require.Equal(t, c.secretAt(sc.JobName, env["METRICS_PASSWORD_FILE"]), c.secretAt("prometheus", sc.BasicAuth.PasswordFile), "job %s: password_file", sc.JobName)
		for _, st := range sc.StaticConfigs {
			scraped[sc.JobName] = append(scraped[sc.JobName], st.Targets...)
		}
	}
	want := map[string][]string{}
	for _, svc := range metrics {
		_, port, err := net.SplitHostPort(c.env(svc)["METRICS_ADDR"])
		require.NoError(t, err)
		want[svc] = []string{svc + ":" + port}
	}
	require.Equal(t, want, scraped)
}

// TestComposeSecretsScript runs scripts/compose-secrets.sh as a compose
// user would and checks that it makes every secret the file names, that
// the passwords that must agree do (pgpass and PostgreSQL's, htpasswd and
// the indexer's), and that a second run keeps them.
func TestComposeSecretsScript(t *testing.T) {
	t.Parallel()
	c := loadSecureCompose(t)
	dir := filepath.Join(t.TempDir(), "secrets")
	script := filepath.Join(stack.RepoRoot(), "scripts/compose-secrets.sh")
	p := testproc.Run(t, time.Minute, script, nil, dir)
	require.Equal(t, 0, p.ExitCode(), "%s\n%s", p.Stdout(), p.Stderr())

	st, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm(), "the secrets directory")
	read := func(secret string) string {
		t.Helper()
		s, ok := c.doc.Secrets[secret]
		require.True(t, ok, "secret %s", secret)
		b, err := os.ReadFile(filepath.Join(dir, strings.TrimPrefix(s.File, "./secrets/")))
		require.NoError(t, err, "secret %s", secret)
		return strings.TrimSpace(string(b))
	}
	contents := map[string]string{}
	for name := range c.doc.Secrets {
		contents[name] = read(name)
		require.NotEmpty(t, contents[name], name)
	}
	for _, pw := range []string{"postgres_password", "kafka_password", "search_password", "metrics_password"} {
		require.GreaterOrEqual(t, len(contents[pw]), 32, "%s is short", pw)
	}

	// pgpass: the line pgx looks up for the clients' DATABASE_URL.
	u, err := url.Parse(c.env("publisher")["DATABASE_URL"])
	require.NoError(t, err)
	pgpassSecret := c.secretAt("publisher", u.Query().Get("passfile"))
	require.Equal(t, fmt.Sprintf("%s:%s:%s:%s:%s", u.Hostname(), u.Port(), strings.TrimPrefix(u.Path, "/"), u.User.Username(), contents["postgres_password"]), contents[pgpassSecret])
	require.Equal(t, c.env("postgres")["POSTGRES_USER"], u.User.Username())

	// htpasswd: the indexer's user and password.
	indexer := c.env("indexer")
	user, hash, ok := strings.Cut(contents["search_htpasswd"], ":")
	require.True(t, ok)
	require.Equal(t, indexer["ELASTICSEARCH_USERNAME"], user)
	parts := strings.Split(hash, "$") // "", "apr1", salt, digest
	require.Len(t, parts, 4, hash)
	out, err := exec.Command("openssl", "passwd", "-apr1", "-salt", parts[2], contents[c.secretAt("indexer", indexer["ELASTICSEARCH_PASSWORD_FILE"])]).Output()
	require.NoError(t, err)
	require.Equal(t, hash, strings.TrimSpace(string(out)), "htpasswd does not hold the indexer's password")

	p = testproc.Run(t, time.Minute, script, nil, dir)
	require.Equal(t, 0, p.ExitCode(), "%s\n%s", p.Stdout(), p.Stderr())
	for name, want := range contents {
		require.Equal(t, want, read(name), "a second run changed %s", name)
	}
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
