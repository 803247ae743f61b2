// Package kubernetes holds outboxrelay's Kubernetes manifests (the YAML
// files in this directory) and, in manifests_test.go, the test that
// decodes each of them strictly into the official API types and checks
// every setting they use against the binaries' --help.
//
// It is a module of its own so that k8s.io/api stays out of the product's
// go.mod.
package kubernetes

//go:generate go run ./internal/gen
