package configmaps

import (
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// TestRenderKeepsContentExactly: the ConfigMap's data reads back as the
// file, byte for byte, for content a literal block holds and content it
// cannot (no final newline, blank lines at the end, leading spaces, tabs,
// carriage returns), so an edit to alerts.yml or the dashboard can never
// make a ConfigMap that differs silently.
func TestRenderKeepsContentExactly(t *testing.T) {
	for name, content := range map[string]string{
		"plain":              "groups:\n  - name: x\n",
		"no final newline":   "a: 1\nb: 2",
		"blank lines at end": "a: 1\n\n\n",
		"blank line inside":  "a: 1\n\nb: 2\n",
		"leading spaces":     "  indented: first\nnext: line\n",
		"tabs":               "{\n\t\"a\": 1\n}\n",
		"carriage returns":   "a: 1\r\nb: 2\r\n",
		"trailing spaces":    "a: 1   \nb: 2\n",
		"only a newline":     "\n",
		"document markers":   "---\na: 1\n...\n",
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "src.yml"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := Render(dir, Map{Manifest: "x.yaml", Name: "x", Source: "src.yml", Comment: "c"})
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		var cm corev1.ConfigMap
		if err := yaml.UnmarshalStrict(out, &cm); err != nil {
			t.Errorf("%s: %v\n%s", name, err, out)
			continue
		}
		if got := cm.Data["src.yml"]; got != content {
			t.Errorf("%s: data %q, want %q\n%s", name, got, content, out)
		}
	}
}
