// Command promql parses every PromQL expression leasehold ships, so a typo in
// an alert or a dashboard panel fails `make helm-lint` instead of a page at
// night: the expr of every rule in the PrometheusRule documents of rendered
// manifests (YAML), and every "expr" of a Grafana dashboard (JSON, with the
// dashboard's $__rate_interval and $variables substituted).
//
// It is its own module, outside go.work and apart from tools/k8s, because
// the Prometheus module would otherwise move the versions that helm and buf
// build with.
//
// Usage: go run . FILE...   (*.json: dashboards; anything else: manifests)
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"
)

type rule struct {
	Alert  string `yaml:"alert"`
	Record string `yaml:"record"`
	Expr   string `yaml:"expr"`
	For    string `yaml:"for"`
}

type manifest struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name string `yaml:"name"`
	} `yaml:"metadata"`
	Spec struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []rule `yaml:"rules"`
		} `yaml:"groups"`
	} `yaml:"spec"`
}

var p = parser.NewParser(parser.Options{})

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: promql FILE...")
		os.Exit(2)
	}
	var errs []error
	n := 0
	for _, path := range os.Args[1:] {
		b, err := os.ReadFile(path)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var c int
		if strings.HasSuffix(path, ".json") {
			c, err = dashboard(path, b)
		} else {
			c, err = manifests(path, b)
		}
		n += c
		if err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("promql: %d expressions parsed\n", n)
}

func manifests(path string, b []byte) (int, error) {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	var errs []error
	n := 0
	for {
		var m manifest
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return n, fmt.Errorf("%s: %w", path, err)
		}
		if m.Kind != "PrometheusRule" {
			continue
		}
		for _, g := range m.Spec.Groups {
			for _, r := range g.Rules {
				name := r.Alert + r.Record
				n++
				if _, err := p.ParseExpr(r.Expr); err != nil {
					errs = append(errs, fmt.Errorf("%s: %s/%s %s: %w\n  %s", path, m.Metadata.Name, g.Name, name, err, r.Expr))
				}
				if r.For != "" {
					if _, err := model.ParseDuration(r.For); err != nil {
						errs = append(errs, fmt.Errorf("%s: %s %s: for %q: %w", path, g.Name, name, r.For, err))
					}
				}
			}
		}
	}
	return n, errors.Join(errs...)
}

// Grafana's variables, replaced by values PromQL accepts.
var grafanaVars = regexp.MustCompile(`\$(__rate_interval|__interval|__range)|\$\{[A-Za-z_]+[^}]*\}|\$[A-Za-z_]+`)

func dashboard(path string, b []byte) (int, error) {
	var doc any
	if err := json.Unmarshal(b, &doc); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	var errs []error
	n := 0
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if s, ok := x.(string); ok && k == "expr" {
					n++
					e := grafanaVars.ReplaceAllStringFunc(s, func(m string) string {
						if strings.HasPrefix(m, "$__") {
							return "5m"
						}
						return "x"
					})
					if _, err := p.ParseExpr(e); err != nil {
						errs = append(errs, fmt.Errorf("%s: %w\n  %s", path, err, s))
					}
					continue
				}
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		}
	}
	walk(doc)
	return n, errors.Join(errs...)
}
