package kubernetes_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/intstr"
	kyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/outboxrelay/outboxrelay/deploy/kubernetes/internal/configmaps"
)

// The image every container runs: the Dockerfile's, tagged as in
// docker-compose.yml.
const image = "outboxrelay:dev"

// The Secret that holds every *_FILE value, and its example.
const (
	secretName    = "outboxrelay"
	secretExample = "secret.example.yaml"
)

var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, policyv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}()

// strict is the API server's own YAML decoding with unknown and duplicate
// fields as errors (sigs.k8s.io/json: field names are case-sensitive).
var strict = kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Yaml: true, Strict: true})

// decodeStrict decodes one YAML document into the official type of its
// apiVersion and kind.
func decodeStrict(doc []byte) (runtime.Object, error) {
	obj, _, err := strict.Decode(doc, nil, nil)
	return obj, err
}

// document is one decoded manifest document.
type document struct {
	file string
	obj  runtime.Object
}

func (d document) String() string {
	m, _ := d.obj.(metav1.Object)
	return fmt.Sprintf("%s: %T %s", d.file, d.obj, m.GetName())
}

// splitDocuments returns the YAML documents of b that hold anything but
// comments.
func splitDocuments(t *testing.T, b []byte) [][]byte {
	t.Helper()
	r := kyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var out [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("split documents: %v", err)
		}
		var v any
		if err := yaml.Unmarshal(doc, &v); err != nil {
			t.Fatalf("%v", err)
		}
		if v != nil {
			out = append(out, doc)
		}
	}
}

// manifestFiles are the YAML files of this directory but kustomization.yaml.
func manifestFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	files = slices.DeleteFunc(files, func(f string) bool { return f == "kustomization.yaml" })
	if len(files) == 0 {
		t.Fatal("no manifest")
	}
	return files
}

var (
	loadOnce sync.Once
	loaded   []document
	loadErr  error
)

// documents decodes every document of every manifest strictly; the first
// failure fails the test.
func documents(t *testing.T) []document {
	t.Helper()
	loadOnce.Do(func() {
		for _, f := range manifestFiles(t) {
			b, err := os.ReadFile(f)
			if err != nil {
				loadErr = err
				return
			}
			for i, doc := range splitDocuments(t, b) {
				obj, err := decodeStrict(doc)
				if err != nil {
					loadErr = fmt.Errorf("%s, document %d: %w", f, i+1, err)
					return
				}
				loaded = append(loaded, document{file: f, obj: obj})
			}
		}
	})
	if loadErr != nil {
		t.Fatal(loadErr)
	}
	return loaded
}

func TestManifestsDecodeStrictly(t *testing.T) {
	docs := documents(t)
	kinds := map[string]int{}
	for _, d := range docs {
		kinds[fmt.Sprintf("%T", d.obj)]++
	}
	t.Logf("decoded %d documents: %v", len(docs), kinds)
	for _, want := range []string{"*v1.Deployment", "*v1.PodDisruptionBudget", "*v1.CronJob", "*v1.Job", "*v1.ConfigMap", "*v1.Secret"} {
		if kinds[want] == 0 {
			t.Errorf("no %s among the manifests", want)
		}
	}

	// kustomization.yaml lists every manifest but the Secret's example,
	// and only files that exist.
	b, err := os.ReadFile("kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Resources  []string `json:"resources"`
	}
	if err := yaml.UnmarshalStrict(b, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("kustomization.yaml: apiVersion %q kind %q", k.APIVersion, k.Kind)
	}
	want := slices.DeleteFunc(manifestFiles(t), func(f string) bool { return f == secretExample })
	slices.Sort(want)
	got := slices.Sorted(slices.Values(k.Resources))
	if !slices.Equal(got, want) {
		t.Errorf("kustomization.yaml resources %v, want the manifests %v", got, want)
	}
}

// TestKustomizationBuilds renders kustomization.yaml as `kubectl apply -k`
// does (kustomize's Go API) and decodes what it gives strictly: the same
// objects as the files, the Secret's example aside.
func TestKustomizationBuilds(t *testing.T) {
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), ".")
	if err != nil {
		t.Fatalf("kustomize build: %v", err)
	}
	out, err := m.AsYaml()
	if err != nil {
		t.Fatal(err)
	}
	name := func(o runtime.Object) string {
		return fmt.Sprintf("%T %s", o, o.(metav1.Object).GetName())
	}
	var got, want []string
	for i, doc := range splitDocuments(t, out) {
		obj, err := decodeStrict(doc)
		if err != nil {
			t.Fatalf("kustomize build, document %d: %v", i+1, err)
		}
		got = append(got, name(obj))
	}
	for _, d := range documents(t) {
		if d.file != secretExample {
			want = append(want, name(d.obj))
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("kustomize build gives %v, want the manifests' %v", got, want)
	}
}

// TestReadmeOverlayBuilds builds the overlay of README.md on top of this
// directory, in memory, and checks it sets what it says: the image, the
// namespace and the patched setting.
func TestReadmeOverlayBuilds(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var overlay string
	for _, b := range fencedBlocks(string(readme), "yaml") {
		if strings.Contains(b, "kind: Kustomization") {
			overlay = b
		}
	}
	if overlay == "" {
		t.Fatal("README.md: no yaml block with kind: Kustomization")
	}
	fs := filesys.MakeFsInMemory()
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := fs.WriteFile("/deploy/kubernetes/"+f, b); err != nil {
			t.Fatal(err)
		}
	}
	if err := fs.WriteFile("/deploy/my-cluster/kustomization.yaml", []byte(overlay)); err != nil {
		t.Fatal(err)
	}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fs, "/deploy/my-cluster")
	if err != nil {
		t.Fatalf("kustomize build of the README's overlay: %v", err)
	}
	out, err := m.AsYaml()
	if err != nil {
		t.Fatal(err)
	}
	var objects, containers int
	var url string
	for i, doc := range splitDocuments(t, out) {
		obj, err := decodeStrict(doc)
		if err != nil {
			t.Fatalf("the README's overlay, document %d: %v", i+1, err)
		}
		objects++
		if ns := obj.(metav1.Object).GetNamespace(); ns != "outboxrelay" {
			t.Errorf("the README's overlay: %T %s in namespace %q", obj, obj.(metav1.Object).GetName(), ns)
		}
		var spec *corev1.PodSpec
		switch o := obj.(type) {
		case *appsv1.Deployment:
			spec = &o.Spec.Template.Spec
		case *batchv1.Job:
			spec = &o.Spec.Template.Spec
		case *batchv1.CronJob:
			spec = &o.Spec.JobTemplate.Spec.Template.Spec
		default:
			continue
		}
		for _, c := range allContainers(spec) {
			containers++
			if c.Image != "registry.example.com/outboxrelay:1.0" {
				t.Errorf("the README's overlay: container %s has image %q", c.Name, c.Image)
			}
			if c.Name == "indexer" {
				url, _ = env(c, "ELASTICSEARCH_URL")
				if n := len(c.Env); n < 10 {
					t.Errorf("the README's overlay: the indexer has %d environment variables left: the patch replaced the list", n)
				}
			}
		}
	}
	if objects == 0 || containers == 0 {
		t.Fatalf("the README's overlay: %d objects, %d containers", objects, containers)
	}
	if url != "https://search.prod.internal:9200" {
		t.Errorf("the README's overlay: indexer ELASTICSEARCH_URL %q, want the patched one", url)
	}
}

// fencedBlocks returns the fenced code blocks of markdown in the given
// language, without the indentation of their fence.
func fencedBlocks(markdown, lang string) []string {
	var out []string
	var block []string
	indent, in := "", false
	for _, line := range strings.Split(markdown, "\n") {
		trimmed := strings.TrimLeft(line, " ")
		switch {
		case !in && trimmed == "```"+lang:
			in, indent, block = true, line[:len(line)-len(trimmed)], nil
		case in && trimmed == "```":
			in = false
			out = append(out, strings.Join(block, "\n")+"\n")
		case in:
			block = append(block, strings.TrimPrefix(line, indent))
		}
	}
	return out
}

// TestStrictDecodingCatchesTypos shows the decoding above fails on a
// misspelt field, at any depth and in any letter case, where a lenient
// decoding (or kubectl apply --validate=false) would drop it silently.
func TestStrictDecodingCatchesTypos(t *testing.T) {
	b, err := os.ReadFile("publisher.yaml")
	if err != nil {
		t.Fatal(err)
	}
	deployment := splitDocuments(t, b)[0]
	if _, err := decodeStrict(deployment); err != nil {
		t.Fatalf("publisher.yaml as committed: %v", err)
	}
	lenient := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Yaml: true})
	for _, tc := range []struct{ from, to, field string }{
		{"  replicas: 3", "  replica: 3", "replica"},
		{"readOnlyRootFilesystem: true", "readOnlyRootFileSystem: true", "readOnlyRootFileSystem"},
		{"containerPort: 9102", "containerport: 9102", "containerport"},
		{"periodSeconds: 5", "periodSecond: 5", "periodSecond"},
		{"            defaultMode: 0440", "            defaultMode: 0440\n            defaultMode: 0400", "defaultMode"},
	} {
		typo := bytes.Replace(deployment, []byte(tc.from), []byte(tc.to), 1)
		if bytes.Equal(typo, deployment) {
			t.Fatalf("%q is not in publisher.yaml", tc.from)
		}
		_, err := decodeStrict(typo)
		if err == nil || !runtime.IsStrictDecodingError(err) || !strings.Contains(err.Error(), tc.field+`"`) {
			t.Errorf("%s → %s: got %v, want a strict decoding error naming %q", tc.from, tc.to, err, tc.field)
			continue
		}
		t.Logf("%s → %s: %v", strings.TrimSpace(tc.from), strings.TrimSpace(tc.to), err)
		if _, _, err := lenient.Decode(typo, nil, nil); err != nil {
			t.Errorf("%s → %s: the lenient decoding fails too (%v): the case shows nothing", tc.from, tc.to, err)
		}
	}
}

// podTemplate is a pod template of a workload and where it is.
type podTemplate struct {
	where string
	spec  *corev1.PodSpec
	meta  metav1.ObjectMeta
}

func podTemplates(t *testing.T) []podTemplate {
	var out []podTemplate
	for _, d := range documents(t) {
		switch o := d.obj.(type) {
		case *appsv1.Deployment:
			out = append(out, podTemplate{d.String(), &o.Spec.Template.Spec, o.Spec.Template.ObjectMeta})
		case *batchv1.Job:
			out = append(out, podTemplate{d.String(), &o.Spec.Template.Spec, o.Spec.Template.ObjectMeta})
		case *batchv1.CronJob:
			out = append(out, podTemplate{d.String(), &o.Spec.JobTemplate.Spec.Template.Spec, o.Spec.JobTemplate.Spec.Template.ObjectMeta})
		}
	}
	if len(out) == 0 {
		t.Fatal("no workload")
	}
	return out
}

func allContainers(p *corev1.PodSpec) []corev1.Container {
	return append(slices.Clone(p.InitContainers), p.Containers...)
}

// TestPodsAreLockedDown: non-root, read-only root file system, no
// privilege escalation, no capabilities, no service account token,
// requests and limits of CPU and memory, the project's image.
func TestPodsAreLockedDown(t *testing.T) {
	for _, p := range podTemplates(t) {
		sc := p.spec.SecurityContext
		if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 {
			t.Errorf("%s: the pod's securityContext must set runAsNonRoot: true and a non-zero runAsUser", p.where)
		}
		if p.spec.AutomountServiceAccountToken == nil || *p.spec.AutomountServiceAccountToken {
			t.Errorf("%s: automountServiceAccountToken must be false (nothing here talks to the API server)", p.where)
		}
		for _, c := range allContainers(p.spec) {
			where := p.where + ", container " + c.Name
			if c.Image != image {
				t.Errorf("%s: image %q, want %q", where, c.Image, image)
			}
			cs := c.SecurityContext
			if cs == nil || cs.ReadOnlyRootFilesystem == nil || !*cs.ReadOnlyRootFilesystem ||
				cs.AllowPrivilegeEscalation == nil || *cs.AllowPrivilegeEscalation ||
				cs.Capabilities == nil || !slices.Contains(cs.Capabilities.Drop, "ALL") {
				t.Errorf("%s: securityContext must set readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities.drop [ALL]", where)
			}
			if cs != nil && cs.RunAsUser != nil && *cs.RunAsUser == 0 {
				t.Errorf("%s: runs as root", where)
			}
			for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
				req, okReq := c.Resources.Requests[r]
				lim, okLim := c.Resources.Limits[r]
				if !okReq || !okLim {
					t.Errorf("%s: resources must have requests and limits of %s", where, r)
				} else if req.Cmp(lim) > 0 {
					t.Errorf("%s: %s request %s above its limit %s", where, r, req.String(), lim.String())
				}
			}
		}
	}
}

func env(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

// TestDeploymentProbes: liveness on /healthz and readiness on /readyz, on
// a port the container declares and the service listens on (METRICS_ADDR,
// which defaults to loopback, where no probe reaches).
func TestDeploymentProbes(t *testing.T) {
	n := 0
	for _, d := range documents(t) {
		dep, ok := d.obj.(*appsv1.Deployment)
		if !ok {
			continue
		}
		n++
		for _, c := range dep.Spec.Template.Spec.Containers {
			where := d.String() + ", container " + c.Name
			addr, ok := env(c, "METRICS_ADDR")
			if !ok {
				t.Errorf("%s: no METRICS_ADDR (its default listens on 127.0.0.1 only)", where)
				continue
			}
			host, port, err := net.SplitHostPort(addr)
			if err != nil || (host != "" && host != "0.0.0.0" && host != "::") {
				t.Errorf("%s: METRICS_ADDR=%q: want 0.0.0.0:PORT, reachable by the kubelet", where, addr)
				continue
			}
			if _, ok := env(c, "METRICS_USERNAME"); ok {
				t.Errorf("%s: METRICS_USERNAME puts /readyz behind basic auth, which the probe does not send", where)
			}
			for _, pr := range []struct {
				name, path string
				probe      *corev1.Probe
			}{{"livenessProbe", "/healthz", c.LivenessProbe}, {"readinessProbe", "/readyz", c.ReadinessProbe}} {
				if pr.probe == nil || pr.probe.HTTPGet == nil {
					t.Errorf("%s: no %s with httpGet", where, pr.name)
					continue
				}
				g := pr.probe.HTTPGet
				if g.Path != pr.path {
					t.Errorf("%s: %s path %q, want %q", where, pr.name, g.Path, pr.path)
				}
				if g.Scheme != "" && g.Scheme != corev1.URISchemeHTTP {
					t.Errorf("%s: %s scheme %s: the endpoint serves plain HTTP", where, pr.name, g.Scheme)
				}
				declared, ok := containerPort(c, g.Port)
				if !ok {
					t.Errorf("%s: %s port %s is not a port the container declares", where, pr.name, g.Port.String())
					continue
				}
				if strconv.Itoa(int(declared)) != port {
					t.Errorf("%s: %s probes port %d, METRICS_ADDR listens on %s", where, pr.name, declared, port)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no Deployment")
	}
}

// containerPort resolves a probe's port (a number or a name) to a
// containerPort the container declares.
func containerPort(c corev1.Container, p intstr.IntOrString) (int32, bool) {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp.ContainerPort, true
		}
	}
	return 0, false
}

// TestEveryDeploymentHasADisruptionBudget: exactly one PDB selects each
// Deployment's pods, and it selects no other workload's pods.
func TestEveryDeploymentHasADisruptionBudget(t *testing.T) {
	docs := documents(t)
	var pdbs []*policyv1.PodDisruptionBudget
	for _, d := range docs {
		if p, ok := d.obj.(*policyv1.PodDisruptionBudget); ok {
			pdbs = append(pdbs, p)
		}
	}
	templates := podTemplates(t)
	for _, d := range docs {
		dep, ok := d.obj.(*appsv1.Deployment)
		if !ok {
			continue
		}
		own, err := metav1.LabelSelectorAsSelector(dep.Spec.Selector)
		if err != nil || !own.Matches(labels.Set(dep.Spec.Template.Labels)) {
			t.Errorf("%s: its selector does not select its own pods (%v)", d, err)
		}
		var covering []string
		for _, p := range pdbs {
			sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
			if err != nil || sel.Empty() {
				t.Errorf("PodDisruptionBudget %s: selector %v (%v)", p.Name, p.Spec.Selector, err)
				continue
			}
			if !sel.Matches(labels.Set(dep.Spec.Template.Labels)) {
				continue
			}
			covering = append(covering, p.Name)
			if p.Spec.MinAvailable == nil && p.Spec.MaxUnavailable == nil {
				t.Errorf("PodDisruptionBudget %s: neither minAvailable nor maxUnavailable", p.Name)
			}
			for _, other := range templates {
				if other.where != d.String() && sel.Matches(labels.Set(other.meta.Labels)) {
					t.Errorf("PodDisruptionBudget %s selects the pods of %s too", p.Name, other.where)
				}
			}
		}
		if len(covering) != 1 {
			t.Errorf("%s: PodDisruptionBudgets selecting its pods: %v, want exactly one", d, covering)
		}
	}
}

// secretKeys are the keys of secret.example.yaml.
func secretKeys(t *testing.T) map[string]bool {
	keys := map[string]bool{}
	for _, d := range documents(t) {
		if s, ok := d.obj.(*corev1.Secret); ok && d.file == secretExample && s.Name == secretName {
			for k := range s.StringData {
				keys[k] = true
			}
			for k := range s.Data {
				keys[k] = true
			}
		}
	}
	if len(keys) == 0 {
		t.Fatalf("%s: no Secret %s with keys", secretExample, secretName)
	}
	return keys
}

// configMapKeys are the keys of each ConfigMap of the manifests.
func configMapKeys(t *testing.T) map[string]map[string]bool {
	out := map[string]map[string]bool{}
	for _, d := range documents(t) {
		if cm, ok := d.obj.(*corev1.ConfigMap); ok {
			out[cm.Name] = map[string]bool{}
			for k := range cm.Data {
				out[cm.Name][k] = true
			}
		}
	}
	return out
}

// mountedFile finds the volume that holds file in c's mounts and the key
// of the Secret or ConfigMap it shows there.
func mountedFile(p *corev1.PodSpec, c corev1.Container, file string) (*corev1.Volume, string, bool) {
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, file)
		if err != nil || rel == "." || strings.HasPrefix(rel, "..") || m.SubPath != "" {
			continue
		}
		for i := range p.Volumes {
			v := &p.Volumes[i]
			if v.Name != m.Name {
				continue
			}
			var items []corev1.KeyToPath
			switch {
			case v.Secret != nil:
				items = v.Secret.Items
			case v.ConfigMap != nil:
				items = v.ConfigMap.Items
			default:
				return v, "", false
			}
			if len(items) == 0 {
				return v, rel, true
			}
			for _, it := range items {
				if path.Clean(it.Path) == rel {
					return v, it.Key, true
				}
			}
			return v, "", false
		}
	}
	return nil, "", false
}

// TestFilesComeFromMounts: every *_FILE setting names a file of a mounted
// Secret volume, whose key the example Secret has; every --spec names a
// key of a mounted ConfigMap, and the followed job is incremental.
func TestFilesComeFromMounts(t *testing.T) {
	keys := secretKeys(t)
	cms := configMapKeys(t)
	n := 0
	for _, p := range podTemplates(t) {
		for _, c := range allContainers(p.spec) {
			where := p.where + ", container " + c.Name
			for _, e := range c.Env {
				if !strings.HasSuffix(e.Name, "_FILE") {
					continue
				}
				n++
				v, key, ok := mountedFile(p.spec, c, e.Value)
				switch {
				case !ok:
					t.Errorf("%s: %s=%s is not a file of a mounted volume (or not among its items)", where, e.Name, e.Value)
				case v.Secret == nil:
					t.Errorf("%s: %s=%s is in volume %s, which is not a Secret", where, e.Name, e.Value, v.Name)
				case v.Secret.SecretName != secretName || !keys[key]:
					t.Errorf("%s: %s=%s is key %q of Secret %s, which %s does not have", where, e.Name, e.Value, key, v.Secret.SecretName, secretExample)
				case v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o007 != 0:
					t.Errorf("%s: volume %s: set defaultMode without bits for others (0440 or 0400)", where, v.Name)
				}
			}
			args := append(slices.Clone(c.Command), c.Args...)
			for i, a := range args {
				if a != "--spec" || i+1 == len(args) {
					continue
				}
				v, key, ok := mountedFile(p.spec, c, args[i+1])
				if !ok || v.ConfigMap == nil || !cms[v.ConfigMap.Name][key] {
					t.Errorf("%s: --spec %s is not a key of a mounted ConfigMap of the manifests", where, args[i+1])
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no *_FILE setting in the manifests")
	}
}

// TestBatcherSchedules: the follower follows an incremental job (the
// batcher refuses --follow for any other), and the scheduled runs never
// overlap.
func TestBatcherSchedules(t *testing.T) {
	var followed, cron int
	for _, d := range documents(t) {
		switch o := d.obj.(type) {
		case *batchv1.CronJob:
			cron++
			if o.Spec.ConcurrencyPolicy != batchv1.ForbidConcurrent {
				t.Errorf("%s: concurrencyPolicy %q, want Forbid", d, o.Spec.ConcurrencyPolicy)
			}
		case *appsv1.Deployment:
			for _, c := range o.Spec.Template.Spec.Containers {
				if !slices.Contains(c.Command, "--follow") {
					continue
				}
				followed++
				i := slices.Index(c.Command, "--spec")
				if i < 0 || i+1 == len(c.Command) {
					t.Errorf("%s: --follow without --spec", d)
					continue
				}
				_, key, _ := mountedFile(&o.Spec.Template.Spec, c, c.Command[i+1])
				var spec struct {
					Mode string `json:"mode"`
				}
				if err := yaml.Unmarshal([]byte(jobSpec(t, key)), &spec); err != nil || spec.Mode != "incremental" {
					t.Errorf("%s: follows a job of mode %q (%v): --follow needs mode: incremental", d, spec.Mode, err)
				}
			}
		}
	}
	if followed != 1 || cron != 1 {
		t.Errorf("%d followers and %d CronJobs, want one each", followed, cron)
	}
}

func jobSpec(t *testing.T, key string) string {
	for _, d := range documents(t) {
		if cm, ok := d.obj.(*corev1.ConfigMap); ok && cm.Name == "outboxrelay-job" {
			return cm.Data[key]
		}
	}
	t.Fatal("no ConfigMap outboxrelay-job")
	return ""
}

// TestConfigMapsMatchSources: the rules and dashboard ConfigMaps are what
// `go generate` writes now, and their data is the files' content.
func TestConfigMapsMatchSources(t *testing.T) {
	for _, m := range configmaps.Maps {
		want, err := configmaps.Render("..", m)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(m.Manifest)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from what deploy/%s makes: run `make k8s-configmaps` (go generate in deploy/kubernetes)", m.Manifest, m.Source)
		}
		src, err := os.ReadFile(filepath.Join("..", m.Source))
		if err != nil {
			t.Fatal(err)
		}
		var found bool
		for _, d := range documents(t) {
			if cm, ok := d.obj.(*corev1.ConfigMap); ok && d.file == m.Manifest {
				found = true
				if cm.Data[filepath.Base(m.Source)] != string(src) {
					t.Errorf("%s: data %s is not deploy/%s", m.Manifest, filepath.Base(m.Source), m.Source)
				}
			}
		}
		if !found {
			t.Errorf("%s: no ConfigMap", m.Manifest)
		}
	}
}

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// binaries builds the three binaries from the parent module.
func binaries(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "outboxrelay-k8s-bin")
		if buildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", binDir+string(filepath.Separator), "./cmd/batcher", "./cmd/publisher", "./cmd/indexer")
		cmd.Dir = filepath.Join("..", "..")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// A setting in `<binary> <command> --help`: "  --flag  (env NAME, default …)".
var settingRE = regexp.MustCompile(`(?m)^  --([a-z0-9-]+)  \(env ([A-Z0-9_]+|-), default `)

// TestSettingsExistInBinaries: every command the manifests run is a command
// of its binary, and every environment variable and flag they set is one
// of that command's settings (a misspelt variable is otherwise ignored
// without a word).
func TestSettingsExistInBinaries(t *testing.T) {
	bin := binaries(t)
	n := 0
	for _, p := range podTemplates(t) {
		for _, c := range allContainers(p.spec) {
			where := p.where + ", container " + c.Name
			args := append(slices.Clone(c.Command), c.Args...)
			if len(args) == 0 || !slices.Contains([]string{"batcher", "publisher", "indexer"}, args[0]) {
				t.Errorf("%s: command %v does not start with batcher, publisher or indexer", where, args)
				continue
			}
			sub := slices.Clone(args[1:])
			if i := slices.IndexFunc(sub, func(a string) bool { return strings.HasPrefix(a, "-") }); i >= 0 {
				sub = sub[:i]
			}
			if len(sub) == 0 {
				t.Errorf("%s: %v names no command", where, args)
				continue
			}
			cmd := exec.Command(filepath.Join(bin, args[0]), append(slices.Clone(sub), "--help")...)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH")} // none of the settings under test
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			usage := fmt.Sprintf("Usage: %s %s [flags]\n", args[0], strings.Join(sub, " "))
			if err := cmd.Run(); err != nil || !strings.HasPrefix(stdout.String(), usage) {
				t.Errorf("%s: `%s %s --help`: %v, stdout %q, stderr %q: not a command of %s", where, args[0], strings.Join(sub, " "), err, firstLine(stdout.String()), firstLine(stderr.String()), args[0])
				continue
			}
			flags, envs := map[string]bool{}, map[string]bool{}
			for _, m := range settingRE.FindAllStringSubmatch(stdout.String(), -1) {
				flags[m[1]] = true
				envs[m[2]] = true
			}
			if len(flags) == 0 {
				t.Fatalf("%s: no setting read from `%s %s --help`:\n%s", where, args[0], strings.Join(sub, " "), stdout.String())
			}
			for _, e := range c.Env {
				n++
				if !envs[e.Name] {
					t.Errorf("%s: %s is not a setting of `%s %s`", where, e.Name, args[0], strings.Join(sub, " "))
				}
			}
			for _, a := range args[1+len(sub):] {
				name, ok := strings.CutPrefix(a, "--")
				if !ok {
					continue
				}
				name, _, _ = strings.Cut(name, "=")
				n++
				if !flags[name] {
					t.Errorf("%s: --%s is not a flag of `%s %s`", where, name, args[0], strings.Join(sub, " "))
				}
			}
		}
	}
	t.Logf("%d settings checked against the binaries", n)
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
