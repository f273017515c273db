// Command netpolcheck evaluates the NetworkPolicies of a rendered Helm chart
// (`helm template` output) for a table of connections and reports which are
// allowed and which denied, against what the table expects. deploy/helm/check.sh
// runs it (and so `make helm-lint`).
//
// Usage: go run ./netpolcheck -render NAME=FILE [-render NAME=FILE ...] < CASES
//
// Each line of CASES is "render from to port expect", # starts a comment:
//
//	default  api     gateway  9444      deny
//	tunnels  api     gateway  9444      allow
//	default  worker  dns      53/udp    allow
//
// from and to are endpoints: a component of the chart (the app.kubernetes.io/component
// label of a Deployment's, Job's or CronJob's pod template: api, gateway, worker,
// scheduler, doctor, doctor-check, migrate), or one of the fixed endpoints below.
// port is a number, optionally /udp or /sctp (TCP otherwise), or the name of a
// container port of the destination component (e.g. health, relay).
//
// The semantics are those of networking.k8s.io/v1: a pod selected by no policy
// of a direction allows everything in that direction; a selected pod allows
// what any rule of any selecting policy allows; a connection needs the
// source's egress and the destination's ingress. Peers are matched by pod and
// namespace selectors (namespaces carry kubernetes.io/metadata.name) and by
// ipBlock (every endpoint has an IP; pods in the cluster network 10.0.0.0/8).
// Traffic from the node (kubelet probes) is not modelled: most CNIs never
// apply NetworkPolicy to it.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// endpoint is one side of a connection.
type endpoint struct {
	name      string
	namespace string            // "" outside the cluster
	labels    map[string]string // nil: not a pod
	ip        netip.Addr
	ports     []corev1.ContainerPort
}

func (e endpoint) isPod() bool { return e.labels != nil }

// fixed endpoints beside the chart's components. The release is rendered in
// namespace leasehold.
func fixed() map[string]endpoint {
	ep := func(name, ns string, l map[string]string, ip string) endpoint {
		return endpoint{name: name, namespace: ns, labels: l, ip: netip.MustParseAddr(ip)}
	}
	return map[string]endpoint{
		// Prometheus in the monitoring namespace.
		"monitoring": ep("monitoring", "monitoring", map[string]string{"app.kubernetes.io/name": "prometheus"}, "10.2.0.10"),
		// Any pod of another namespace.
		"other-ns": ep("other-ns", "default", map[string]string{"app": "client"}, "10.3.0.10"),
		// A pod of the release namespace that is not part of the chart.
		"same-ns": ep("same-ns", "leasehold", map[string]string{"app": "intruder"}, "10.1.9.10"),
		// CoreDNS.
		"dns": ep("dns", "kube-system", map[string]string{"k8s-app": "kube-dns"}, "10.4.0.10"),
		// Outside the cluster network.
		"internet": ep("internet", "", nil, "203.0.113.7"),
		"postgres": ep("postgres", "", nil, "192.0.2.10"),
	}
}

type policy struct {
	np       networkingv1.NetworkPolicy
	selector labels.Selector
}

type render struct {
	endpoints map[string]endpoint
	policies  []policy
}

func selector(s *metav1.LabelSelector) (labels.Selector, error) {
	if s == nil {
		return labels.Nothing(), nil
	}
	return metav1.LabelSelectorAsSelector(s)
}

// load reads the multi-document YAML of `helm template`.
func load(data []byte) (*render, error) {
	r := &render{endpoints: fixed()}
	n := 0
	for _, doc := range bytes.Split(data, []byte("\n---")) {
		var head struct {
			Kind     string `json:"kind"`
			Metadata struct {
				Namespace string `json:"namespace"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(doc, &head); err != nil {
			return nil, fmt.Errorf("a document does not parse: %w", err)
		}
		var tpl *corev1.PodTemplateSpec
		switch head.Kind {
		case "NetworkPolicy":
			var np networkingv1.NetworkPolicy
			if err := yaml.UnmarshalStrict(doc, &np); err != nil {
				return nil, fmt.Errorf("NetworkPolicy: %w", err)
			}
			sel, err := selector(&np.Spec.PodSelector)
			if err != nil {
				return nil, fmt.Errorf("NetworkPolicy %s: %w", np.Name, err)
			}
			r.policies = append(r.policies, policy{np: np, selector: sel})
			continue
		case "Deployment":
			var d appsv1.Deployment
			if err := yaml.Unmarshal(doc, &d); err != nil {
				return nil, err
			}
			tpl = &d.Spec.Template
		case "Job":
			var j batchv1.Job
			if err := yaml.Unmarshal(doc, &j); err != nil {
				return nil, err
			}
			tpl = &j.Spec.Template
		case "CronJob":
			var c batchv1.CronJob
			if err := yaml.Unmarshal(doc, &c); err != nil {
				return nil, err
			}
			tpl = &c.Spec.JobTemplate.Spec.Template
		default:
			continue
		}
		comp := tpl.Labels["app.kubernetes.io/component"]
		if comp == "" {
			return nil, fmt.Errorf("a %s's pod template has no app.kubernetes.io/component label", head.Kind)
		}
		n++
		e := endpoint{name: comp, namespace: head.Metadata.Namespace, labels: tpl.Labels,
			ip: netip.AddrFrom4([4]byte{10, 1, byte(n), 10})}
		for _, c := range tpl.Spec.Containers {
			e.ports = append(e.ports, c.Ports...)
		}
		r.endpoints[comp] = e
	}
	return r, nil
}

// nsLabels are the labels of a namespace: the API server sets
// kubernetes.io/metadata.name on every namespace.
func nsLabels(ns string) labels.Set { return labels.Set{"kubernetes.io/metadata.name": ns} }

// peerMatches reports whether peer (a rule of a policy in namespace ns) matches e.
func peerMatches(peer networkingv1.NetworkPolicyPeer, ns string, e endpoint) (bool, error) {
	if peer.IPBlock != nil {
		cidr, err := netip.ParsePrefix(peer.IPBlock.CIDR)
		if err != nil {
			return false, fmt.Errorf("ipBlock %q: %w", peer.IPBlock.CIDR, err)
		}
		if !cidr.Contains(e.ip) {
			return false, nil
		}
		for _, ex := range peer.IPBlock.Except {
			p, err := netip.ParsePrefix(ex)
			if err != nil {
				return false, fmt.Errorf("ipBlock except %q: %w", ex, err)
			}
			if p.Contains(e.ip) {
				return false, nil
			}
		}
		return true, nil
	}
	if !e.isPod() {
		return false, nil // selectors match pods only
	}
	if peer.NamespaceSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(peer.NamespaceSelector)
		if err != nil {
			return false, err
		}
		if !sel.Matches(nsLabels(e.namespace)) {
			return false, nil
		}
	} else if e.namespace != ns {
		return false, nil // a podSelector alone means the policy's namespace
	}
	if peer.PodSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(peer.PodSelector)
		if err != nil {
			return false, err
		}
		return sel.Matches(labels.Set(e.labels)), nil
	}
	return true, nil
}

// portMatches reports whether the rule's ports admit port/proto on dst.
func portMatches(ports []networkingv1.NetworkPolicyPort, port int, proto corev1.Protocol, dst endpoint) bool {
	if len(ports) == 0 {
		return true
	}
	for _, p := range ports {
		pp := corev1.ProtocolTCP
		if p.Protocol != nil {
			pp = *p.Protocol
		}
		if pp != proto {
			continue
		}
		if p.Port == nil {
			return true
		}
		if p.Port.Type == intstr.String {
			// A named port: the destination's container port of that name.
			for _, cp := range dst.ports {
				cpp := cp.Protocol
				if cpp == "" {
					cpp = corev1.ProtocolTCP
				}
				if cp.Name == p.Port.StrVal && int(cp.ContainerPort) == port && cpp == proto {
					return true
				}
			}
			continue
		}
		lo := int(p.Port.IntVal)
		hi := lo
		if p.EndPort != nil {
			hi = int(*p.EndPort)
		}
		if port >= lo && port <= hi {
			return true
		}
	}
	return false
}

func hasType(np networkingv1.NetworkPolicy, t networkingv1.PolicyType) bool {
	if len(np.Spec.PolicyTypes) == 0 {
		// The API server's default: Ingress, plus Egress when egress rules exist.
		return t == networkingv1.PolicyTypeIngress || len(np.Spec.Egress) > 0
	}
	for _, pt := range np.Spec.PolicyTypes {
		if pt == t {
			return true
		}
	}
	return false
}

// allowed evaluates one direction: egress of src (toward dst) or ingress of
// dst (from src). It returns the verdict and the policies that decided it.
func (r *render) allowed(dir networkingv1.PolicyType, src, dst endpoint, port int, proto corev1.Protocol) (bool, []string, error) {
	subject, peer := src, dst
	if dir == networkingv1.PolicyTypeIngress {
		subject, peer = dst, src
	}
	if !subject.isPod() {
		return true, nil, nil // nothing outside the cluster is policed here
	}
	var selecting []string
	for _, p := range r.policies {
		if p.np.Namespace != subject.namespace || !hasType(p.np, dir) || !p.selector.Matches(labels.Set(subject.labels)) {
			continue
		}
		selecting = append(selecting, p.np.Name)
		if dir == networkingv1.PolicyTypeEgress {
			for _, rule := range p.np.Spec.Egress {
				ok, err := ruleMatches(rule.To, rule.Ports, p.np.Namespace, peer, port, proto, dst)
				if err != nil || ok {
					return ok, []string{p.np.Name}, err
				}
			}
		} else {
			for _, rule := range p.np.Spec.Ingress {
				ok, err := ruleMatches(rule.From, rule.Ports, p.np.Namespace, peer, port, proto, dst)
				if err != nil || ok {
					return ok, []string{p.np.Name}, err
				}
			}
		}
	}
	return len(selecting) == 0, selecting, nil
}

func ruleMatches(peers []networkingv1.NetworkPolicyPeer, ports []networkingv1.NetworkPolicyPort, ns string, peer endpoint, port int, proto corev1.Protocol, dst endpoint) (bool, error) {
	if !portMatches(ports, port, proto, dst) {
		return false, nil
	}
	if len(peers) == 0 {
		return true, nil // no from/to: every peer
	}
	for _, pe := range peers {
		ok, err := peerMatches(pe, ns, peer)
		if err != nil || ok {
			return ok, err
		}
	}
	return false, nil
}

// parsePort reads "9444", "53/udp" or a container port name of dst.
func parsePort(s string, dst endpoint) (int, corev1.Protocol, error) {
	num, proto, _ := strings.Cut(s, "/")
	p := corev1.ProtocolTCP
	switch strings.ToLower(proto) {
	case "", "tcp":
	case "udp":
		p = corev1.ProtocolUDP
	case "sctp":
		p = corev1.ProtocolSCTP
	default:
		return 0, "", fmt.Errorf("port %q: protocol %q", s, proto)
	}
	if n, err := strconv.Atoi(num); err == nil {
		return n, p, nil
	}
	for _, cp := range dst.ports {
		if cp.Name == num {
			return int(cp.ContainerPort), p, nil
		}
	}
	return 0, "", fmt.Errorf("port %q: %s has no container port of that name", s, dst.name)
}

type renders map[string]string

func (r renders) String() string { return fmt.Sprint(map[string]string(r)) }
func (r renders) Set(v string) error {
	name, file, ok := strings.Cut(v, "=")
	if !ok || name == "" || file == "" {
		return fmt.Errorf("-render %q: want NAME=FILE", v)
	}
	r[name] = file
	return nil
}

func run(files renders, cases io.Reader, out io.Writer) (failures int, err error) {
	loaded := map[string]*render{}
	for name, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			return 0, err
		}
		r, err := load(data)
		if err != nil {
			return 0, fmt.Errorf("%s (%s): %w", name, file, err)
		}
		if len(r.policies) == 0 {
			return 0, fmt.Errorf("%s (%s): no NetworkPolicy rendered", name, file)
		}
		loaded[name] = r
	}
	sc := bufio.NewScanner(cases)
	line, checked := 0, 0
	for sc.Scan() {
		line++
		text, _, _ := strings.Cut(sc.Text(), "#")
		f := strings.Fields(text)
		if len(f) == 0 {
			continue
		}
		if len(f) != 5 || (f[4] != "allow" && f[4] != "deny") {
			return failures, fmt.Errorf("case line %d: want \"render from to port allow|deny\", got %q", line, sc.Text())
		}
		r, ok := loaded[f[0]]
		if !ok {
			return failures, fmt.Errorf("case line %d: no -render named %q", line, f[0])
		}
		src, ok1 := r.endpoints[f[1]]
		dst, ok2 := r.endpoints[f[2]]
		if !ok1 || !ok2 {
			names := make([]string, 0, len(r.endpoints))
			for n := range r.endpoints {
				names = append(names, n)
			}
			sort.Strings(names)
			return failures, fmt.Errorf("case line %d: unknown endpoint in %q (known in %s: %s)", line, sc.Text(), f[0], strings.Join(names, " "))
		}
		port, proto, err := parsePort(f[3], dst)
		if err != nil {
			return failures, fmt.Errorf("case line %d: %w", line, err)
		}
		eg, egBy, err := r.allowed(networkingv1.PolicyTypeEgress, src, dst, port, proto)
		if err != nil {
			return failures, fmt.Errorf("case line %d: %w", line, err)
		}
		in, inBy, err := r.allowed(networkingv1.PolicyTypeIngress, src, dst, port, proto)
		if err != nil {
			return failures, fmt.Errorf("case line %d: %w", line, err)
		}
		got := "deny"
		if eg && in {
			got = "allow"
		}
		why := fmt.Sprintf("egress %v %v, ingress %v %v", verdict(eg), egBy, verdict(in), inBy)
		checked++
		if got != f[4] {
			failures++
			fmt.Fprintf(out, "FAIL %-8s %s -> %s:%d/%s: %s, want %s (%s)\n", f[0], f[1], f[2], port, proto, got, f[4], why)
		} else {
			fmt.Fprintf(out, "ok   %-8s %s -> %s:%d/%s: %s\n", f[0], f[1], f[2], port, proto, got)
		}
	}
	if err := sc.Err(); err != nil {
		return failures, err
	}
	if checked == 0 {
		return 0, fmt.Errorf("no cases")
	}
	return failures, nil
}

func verdict(ok bool) string {
	if ok {
		return "allows"
	}
	return "denies"
}

func main() {
	files := renders{}
	flag.Var(files, "render", "NAME=FILE: a `helm template` output the cases name as NAME (repeatable)")
	flag.Parse()
	failures, err := run(files, os.Stdin, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "netpolcheck:", err)
		os.Exit(2)
	}
	if failures > 0 {
		fmt.Fprintf(os.Stderr, "netpolcheck: %d case(s) not as expected\n", failures)
		os.Exit(1)
	}
}
