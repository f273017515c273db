// Command schemagen writes strict JSON schemas for kubeconform, one file per
// kind in kubeconform's layout ("{{ .ResourceKind }}{{ .KindSuffix }}.json":
// deployment-apps-v1.json, service-v1.json, servicemonitor-monitoring-v1.json),
// for the kinds the Helm chart in deploy/helm renders.
//
// kubeconform normally downloads its schemas from a public repository at run
// time; this workplace (and an air-gapped CI) reaches no such host, only the
// Go module proxy. So the schemas are derived here, by reflection, from the
// Go types the API server itself decodes into: k8s.io/api and the
// prometheus-operator monitoring/v1 types, at the versions pinned in
// tools/k8s/go.mod. The rules follow the Kubernetes API conventions:
//
//   - a field's name is its json tag; inline structs are merged;
//   - a field without omitempty/omitzero is required (the convention for
//     required fields), except a top-level status;
//   - every object is closed (additionalProperties: false), as in
//     kubeconform's "-strict" schemas, so a misspelt or misplaced field fails;
//   - IntOrString is string|integer, Quantity string|number, Time a string.
//
// Usage: go run ./schemagen -out DIR
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

type kind struct {
	group, version, kind string
	obj                  any
}

var kinds = []kind{
	{"", "v1", "Service", corev1.Service{}},
	{"", "v1", "Secret", corev1.Secret{}},
	{"", "v1", "ConfigMap", corev1.ConfigMap{}},
	{"", "v1", "ServiceAccount", corev1.ServiceAccount{}},
	{"apps", "v1", "Deployment", appsv1.Deployment{}},
	{"apps", "v1", "StatefulSet", appsv1.StatefulSet{}},
	{"batch", "v1", "Job", batchv1.Job{}},
	{"batch", "v1", "CronJob", batchv1.CronJob{}},
	{"policy", "v1", "PodDisruptionBudget", policyv1.PodDisruptionBudget{}},
	{"networking.k8s.io", "v1", "NetworkPolicy", networkingv1.NetworkPolicy{}},
	{"autoscaling", "v2", "HorizontalPodAutoscaler", autoscalingv2.HorizontalPodAutoscaler{}},
	{"rbac.authorization.k8s.io", "v1", "Role", rbacv1.Role{}},
	{"rbac.authorization.k8s.io", "v1", "RoleBinding", rbacv1.RoleBinding{}},
	{"monitoring.coreos.com", "v1", "ServiceMonitor", monitoringv1.ServiceMonitor{}},
	{"monitoring.coreos.com", "v1", "PodMonitor", monitoringv1.PodMonitor{}},
	{"monitoring.coreos.com", "v1", "PrometheusRule", monitoringv1.PrometheusRule{}},
}

type schema = map[string]any

// special maps types with custom JSON encodings to what they accept.
var special = map[string]schema{
	"k8s.io/apimachinery/pkg/util/intstr.IntOrString":               {"type": []string{"string", "integer"}},
	"k8s.io/apimachinery/pkg/api/resource.Quantity":                 {"type": []string{"string", "number"}},
	"k8s.io/apimachinery/pkg/apis/meta/v1.Time":                     {"type": []string{"string", "null"}},
	"k8s.io/apimachinery/pkg/apis/meta/v1.MicroTime":                {"type": []string{"string", "null"}},
	"k8s.io/apimachinery/pkg/apis/meta/v1.Duration":                 {"type": "string"},
	"k8s.io/apimachinery/pkg/runtime.RawExtension":                  {},
	"k8s.io/apimachinery/pkg/apis/meta/v1.FieldsV1":                 {},
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1.JSON": {},
}

type gen struct {
	defs map[string]schema
}

func typeName(t reflect.Type) string { return t.PkgPath() + "." + t.Name() }

func defName(t reflect.Type) string {
	return strings.NewReplacer("/", ".").Replace(typeName(t))
}

// of returns the schema of t, registering named structs as definitions.
func (g *gen) of(t reflect.Type) schema {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Name() != "" {
		if s, ok := special[typeName(t)]; ok {
			return s
		}
	}
	switch t.Kind() {
	case reflect.Bool:
		return schema{"type": "boolean"}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return schema{"type": "integer"}
	case reflect.Float32, reflect.Float64:
		return schema{"type": "number"}
	case reflect.String:
		return schema{"type": "string"}
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 {
			return schema{"type": "string"} // []byte is base64
		}
		return schema{"type": []string{"array", "null"}, "items": g.of(t.Elem())}
	case reflect.Map:
		return schema{"type": []string{"object", "null"}, "additionalProperties": g.of(t.Elem())}
	case reflect.Interface:
		return schema{}
	case reflect.Struct:
		if t.Name() == "" {
			return g.object(t, false)
		}
		name := defName(t)
		if _, ok := g.defs[name]; !ok {
			g.defs[name] = nil // breaks recursion
			g.defs[name] = g.object(t, false)
		}
		return schema{"$ref": "#/definitions/" + name}
	}
	fmt.Fprintf(os.Stderr, "schemagen: %s (%s) accepted as anything\n", t, t.Kind())
	return schema{}
}

func (g *gen) object(t reflect.Type, top bool) schema {
	props := schema{}
	var required []string
	g.fields(t, props, &required, top)
	s := schema{"type": "object", "properties": props, "additionalProperties": false}
	if len(required) > 0 {
		sort.Strings(required)
		s["required"] = required
	}
	return s
}

func (g *gen) fields(t reflect.Type, props schema, required *[]string, top bool) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		inline := strings.Contains(","+opts+",", ",inline,") || (f.Anonymous && name == "")
		if inline {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				g.fields(ft, props, required, top)
				continue
			}
		}
		if name == "" {
			name = f.Name
		}
		props[name] = g.of(f.Type)
		optional := strings.Contains(opts, "omitempty") || strings.Contains(opts, "omitzero") ||
			(top && name == "status")
		if !optional {
			*required = append(*required, name)
		}
	}
}

func fileName(k kind) string {
	suffix := "-" + k.version
	if k.group != "" {
		suffix = "-" + strings.Split(k.group, ".")[0] + "-" + k.version
	}
	return strings.ToLower(k.kind) + suffix + ".json"
}

func main() {
	out := flag.String("out", "", "directory to write the schemas into")
	flag.Parse()
	if *out == "" {
		fmt.Fprintln(os.Stderr, "usage: schemagen -out DIR")
		os.Exit(2)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, k := range kinds {
		g := &gen{defs: map[string]schema{}}
		s := g.object(reflect.TypeOf(k.obj), true)
		apiVersion := k.version
		if k.group != "" {
			apiVersion = k.group + "/" + k.version
		}
		props := s["properties"].(schema)
		props["apiVersion"] = schema{"type": "string", "enum": []string{apiVersion}}
		props["kind"] = schema{"type": "string", "enum": []string{k.kind}}
		s["required"] = append([]string{"apiVersion", "kind", "metadata"}, without(s["required"], "apiVersion", "kind", "metadata")...)
		s["$schema"] = "http://json-schema.org/draft-07/schema#"
		s["title"] = apiVersion + " " + k.kind
		s["definitions"] = g.defs
		b, err := json.MarshalIndent(s, "", " ")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if err := os.WriteFile(filepath.Join(*out, fileName(k)), append(b, '\n'), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
}

func without(v any, drop ...string) []string {
	list, _ := v.([]string)
	var out []string
	for _, s := range list {
		keep := true
		for _, d := range drop {
			if s == d {
				keep = false
			}
		}
		if keep {
			out = append(out, s)
		}
	}
	return out
}
