// Command gen writes the generated ConfigMaps (see package configmaps)
// into the current directory, deploy/kubernetes: `go generate` there, or
// `make k8s-configmaps` at the repository's root.
package main

import (
	"fmt"
	"os"

	"github.com/outboxrelay/outboxrelay/deploy/kubernetes/internal/configmaps"
)

func main() {
	for _, m := range configmaps.Maps {
		out, err := configmaps.Render("..", m)
		if err == nil {
			err = os.WriteFile(m.Manifest, out, 0o644)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "gen: %v\n", err)
			os.Exit(1)
		}
	}
}
