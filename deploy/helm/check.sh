#!/usr/bin/env bash
# Behaviour checks of the chart in deploy/helm/leasehold, run by `make helm-lint`
# after helm lint and kubeconform: the values schema refuses bad values, the
# template guards hold without the schema, the monitoring objects follow the
# cluster's APIs, the Grafana ConfigMap carries the dashboard, and every alert's
# runbook_url names an anchor that docs/runbooks.md has.
#
# Usage: HELM="helm" deploy/helm/check.sh   (make passes the pinned helm)
# NOTES.txt is checked through `helm install --dry-run=client`, which cannot
# be told about extra APIs, so only its no-operator form is checked.
set -euo pipefail
cd "$(dirname "$0")/../.."
HELM=${HELM:-helm}
chart=$PWD/deploy/helm/leasehold
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
# $HELM may be a command with environment assignments (make's
# "GOWORK=off go -C tools/k8s tool helm"): env runs both forms.
helm() { env $HELM "$@"; }
render() { helm template leasehold "$chart" --namespace leasehold "$@"; }
# kinds FILE: the kinds rendered in FILE, one per line.
kinds() { grep -E '^kind: ' "$1" | sed 's/^kind: //' | sort -u; }

echo "== values the schema must refuse (each --set alone)"
# Each line: a --set argument, then a word the error must contain.
while read -r set want; do
	[ -z "$set" ] && continue
	if render --set "$set" >/dev/null 2>"$work/err"; then
		fail "helm template accepted --set $set"
	elif ! grep -q -- "$want" "$work/err"; then
		fail "--set $set failed without naming $want: $(head -c 400 "$work/err")"
	else
		echo "refused: --set $set"
	fi
done <<'CASES'
gateway.maxStreams=lots maxStreams
gateway.maxStreams=0 maxStreams
tunnels.maxPerNode=16 maxPerNode
gateway.replica=3 replica
gateway.replicas=-1 replicas
gateway.helloRate=0 helloRate
gateway.service.type=LoadBalancer,gateway.tls.secretName= secretName
gateway.service.type=NodePort,gateway.tls.secretName= secretName
gateway.service.type=ExternalName type
gateway.service.port=70000 port
gateway.service.loadBalancerSourceRanges[0]=everyone loadBalancerSourceRanges
api.service.type=LoadBalancer,api.tls.secretName= secretName
insecurePlaintext=yes insecurePlaintext
certManager.enabled=true issuerRef
certManager.issuerRef.kind=Vault kind
doctor.serve.tls.secretName=Bad_Name secretName
doctor.serve.service.type=LoadBalancer type
coord.leaseTTL=15 leaseTTL
coord.leaseTTL=1m30s leaseTTL
worker.janitor.commandRetention=7d commandRetention
log.level=verbose level
log.format=xml format
migrations.mode=sometimes mode
image.pullPolicy=Sometimes pullPolicy
metrics.serviceMonitor.enabled=maybe enabled
metrics.prometheusRule.runbookURL=runbooks.md runbookURL
metrics.prometheusRule.certExpiryWarningDays=0 certExpiryWarningDays
topologySpread[0].whenUnsatisfiable=Never whenUnsatisfiable
worker.resources.request.cpu=1 request
worker.podDisruptionBudget.minAvailable=1 podDisruptionBudget
worker.extraArgs[0]=verbose extraArgs
grafana.dashboard.label.x=1 label
database.maxConns=0 maxConns
database.url=mysql://x url
doctor.cron.schedule=often schedule
unknownKey=1 unknownKey
image.digests.api=latest digests
image.digests.web=sha256:0 web
serviceAccount.create=yes create
extraVolumes[0].name=pg,extraVolumes[0].bogus=1 bogus
api.extraVolumeMounts[0].name=pg mountPath
doctor.cron.extraEnv[0].value=x name
migrations.extraVolumes=pg extraVolumes
CASES

echo "== template guards without the schema (--skip-schema-validation)"
for svc in gateway api; do
	if render --skip-schema-validation --set "$svc.service.type=LoadBalancer" --set "$svc.tls.secretName=" \
		--set insecurePlaintext=true >/dev/null 2>"$work/err"; then
		fail "$svc.service.type=LoadBalancer without TLS rendered with --skip-schema-validation"
	elif ! grep -q "set $svc.tls.secretName" "$work/err"; then
		fail "$svc LoadBalancer guard failed without naming $svc.tls.secretName: $(cat "$work/err")"
	else
		echo "refused: $svc.service.type=LoadBalancer without $svc.tls.secretName"
	fi
done

echo "== plaintext only with insecurePlaintext (the chart passes --insecure-plaintext then only)"
for svc in gateway api; do
	if render --set "$svc.tls.secretName=" >/dev/null 2>"$work/err"; then
		fail "$svc without TLS rendered with insecurePlaintext false"
	elif ! grep -q "$svc.tls.secretName is empty and insecurePlaintext is false" "$work/err"; then
		fail "$svc without TLS failed without naming $svc.tls.secretName and insecurePlaintext: $(cat "$work/err")"
	else
		echo "refused: $svc.tls.secretName empty without insecurePlaintext"
	fi
	render --show-only "templates/$svc.yaml" --set "$svc.tls.secretName=" --set insecurePlaintext=true >"$work/plain.yaml" ||
		fail "$svc without TLS and with insecurePlaintext was refused"
	grep -q -- '- --insecure-plaintext$' "$work/plain.yaml" || fail "$svc without TLS and with insecurePlaintext runs without --insecure-plaintext"
	render --show-only "templates/$svc.yaml" --set insecurePlaintext=true >"$work/plain.yaml"
	grep -q -- '--insecure-plaintext' "$work/plain.yaml" && fail "$svc with TLS got --insecure-plaintext from insecurePlaintext alone"
done
if render --set tunnels.enabled=true >/dev/null 2>"$work/err"; then
	fail "tunnels.enabled (a plaintext relay) rendered with insecurePlaintext false"
elif ! grep -q 'tunnels.enabled .*insecurePlaintext is false' "$work/err"; then
	fail "tunnels.enabled failed without naming tunnels.enabled and insecurePlaintext: $(cat "$work/err")"
else
	echo "refused: tunnels.enabled without insecurePlaintext"
fi
render --set tunnels.enabled=true --set tunnels.relayTLS.enabled=true >"$work/relaytls.yaml" ||
	fail "tunnels over relayTLS were refused without insecurePlaintext"
grep -q -- '--insecure-plaintext' "$work/relaytls.yaml" && fail "tunnels over relayTLS got --insecure-plaintext"
for f in '--gateway.relay-tls.client-ca-file=/etc/leasehold/relay-tls/ca.crt' '--gateway.relay-tls.client-name=leasehold-api' \
	'--api.relay-tls.cert-file=/etc/leasehold/relay-client-tls/tls.crt' '--api.relay-tls.server-name=leasehold-gateway-relay'; do
	grep -q -- "- $f$" "$work/relaytls.yaml" || fail "tunnels over relayTLS: no $f"
done
if render --set tunnels.enabled=true --set tunnels.relayToken.existingSecret= --set insecurePlaintext=true >/dev/null 2>"$work/err"; then
	fail "tunnels without a relay token and without relayTLS rendered"
fi
render --set tunnels.enabled=true --set tunnels.relayTLS.enabled=true --set tunnels.relayToken.existingSecret= >"$work/relaytls.yaml" ||
	fail "tunnels over relayTLS without a token were refused"
grep -q 'relay-token' "$work/relaytls.yaml" && fail "tunnels over relayTLS without a token still mount one"
render >"$work/default.yaml"
grep -q -- '--insecure-plaintext' "$work/default.yaml" && fail "default values pass --insecure-plaintext"
grep -q -- '- --api.tls-cert=' "$work/default.yaml" || fail "default values: the api serves no TLS"
grep -q -- '- --tls-cert=/etc/leasehold/tls/tls.crt' "$work/default.yaml" || fail "default values: the gateway serves no TLS"
grep -q -- '- --listen-addr=127.0.0.1:8080' "$work/default.yaml" || fail "default values: DoctorService without TLS is not on loopback"
render --show-only templates/doctor.yaml >"$work/doctor.yaml"
[ "$(grep -c '^kind: Service$' "$work/doctor.yaml")" = 1 ] || fail "default values: a Service besides the metrics one publishes DoctorService on loopback"
render --show-only templates/doctor.yaml --set doctor.serve.tls.secretName=leasehold-doctor-tls >"$work/doctor.yaml"
grep -q -- '- --listen-addr=0.0.0.0:8080' "$work/doctor.yaml" && grep -q -- '- --tls-cert=' "$work/doctor.yaml" ||
	fail "doctor.serve.tls.secretName: DoctorService does not serve TLS on every address"
render --show-only templates/doctor.yaml --set insecurePlaintext=true >"$work/doctor.yaml"
grep -q -- '- --insecure-plaintext' "$work/doctor.yaml" || fail "doctor without TLS, insecurePlaintext: no --insecure-plaintext"
echo "ok"

echo "== cert-manager Certificates write the Secrets the chart mounts"
render --set certManager.enabled=true --set certManager.issuerRef.name=leasehold-ca \
	--set doctor.serve.tls.secretName=leasehold-doctor-tls --set-json 'certManager.gateway.dnsNames=["gw.example.com"]' >"$work/cm.yaml" ||
	fail "certManager.enabled was refused"
n=$(grep -c '^kind: Certificate$' "$work/cm.yaml" || true)
[ "$n" = 3 ] || fail "certManager.enabled rendered $n Certificates, want 3 (api, gateway, doctor)"
render --set certManager.enabled=true --set certManager.issuerRef.name=leasehold-ca \
	--set tunnels.enabled=true --set tunnels.relayTLS.enabled=true >"$work/cm-relay.yaml" || fail "certManager with relayTLS was refused"
for s in leasehold-relay-tls leasehold-relay-client-tls; do
	grep -qx "  secretName: $s" "$work/cm-relay.yaml" || fail "no Certificate writes the relay's $s"
done
grep -qx '    - client auth' "$work/cm-relay.yaml" || fail "the relay client Certificate is not for client auth"
for s in leasehold-api-tls leasehold-gateway-tls leasehold-doctor-tls; do
	grep -qx "  secretName: $s" "$work/cm.yaml" || fail "no Certificate writes $s"
done
grep -qx '    - gw.example.com' "$work/cm.yaml" || fail "certManager.gateway.dnsNames is not in the gateway's Certificate"
grep -q '^kind: Certificate$' "$work/default.yaml" && fail "a Certificate rendered with certManager.enabled false"
echo "ok"

echo "== doctor reads the certificates the values configure (tls.expiry)"
render --show-only templates/doctor.yaml >"$work/doctor.yaml"
n=$(grep -c -- '- --tls-cert-files=/etc/leasehold/certs/api/tls.crt,/etc/leasehold/certs/gateway/tls.crt$' "$work/doctor.yaml" || true)
[ "$n" = 2 ] || fail "doctor serve and check: --tls-cert-files of the api's and gateway's certificates in $n of 2 pods"
grep -q 'key: tls.key' "$work/doctor.yaml" && fail "a private key is mounted into doctor"
render --show-only templates/doctor.yaml --set gateway.tls.clientCASecretName=leasehold-node-ca \
	--set doctor.serve.tls.secretName=leasehold-doctor-tls --set api.enabled=false >"$work/doctor.yaml"
grep -q -- '- --tls-cert-files=/etc/leasehold/certs/gateway/tls.crt,/etc/leasehold/certs/gateway-client-ca/ca.crt,/etc/leasehold/certs/doctor/tls.crt$' "$work/doctor.yaml" ||
	fail "doctor: --tls-cert-files does not follow the configured Secrets (no api, a client CA, its own)"
grep -q 'secretName: leasehold-node-ca' "$work/doctor.yaml" || fail "doctor: the client CA Secret is not mounted"
render --show-only templates/doctor.yaml --set api.tls.secretName= --set gateway.tls.secretName= --set insecurePlaintext=true >"$work/doctor.yaml"
grep -q -- '--tls-cert-files' "$work/doctor.yaml" && fail "doctor: --tls-cert-files without any TLS Secret"
echo "ok"

echo "== values that must be accepted"
render >"$work/default.yaml"
render --show-only templates/gateway.yaml >"$work/gw.yaml"
grep -qx '  type: ClusterIP' "$work/gw.yaml" || fail "the default gateway Service is not ClusterIP"
grep -q 'LoadBalancer' "$work/gw.yaml" && fail "the default gateway Service mentions LoadBalancer"
render --show-only templates/gateway.yaml --set gateway.service.type=LoadBalancer \
	--set gateway.tls.secretName=gw-tls >"$work/lb.yaml" || fail "gateway LoadBalancer with TLS was refused"
grep -qx '  type: LoadBalancer' "$work/lb.yaml" || fail "gateway LoadBalancer with TLS rendered no LoadBalancer"
grep -q -- '--tls-cert=' "$work/lb.yaml" || fail "gateway LoadBalancer with TLS runs without --tls-cert"
render --set api.service.type=LoadBalancer --set api.tls.secretName=api-tls >/dev/null ||
	fail "api LoadBalancer with TLS was refused"
render -f "$chart/values-ha.yaml" >/dev/null || fail "values-ha.yaml was refused"
render --set tunnels.enabled=true --set insecurePlaintext=true >"$work/tunnels.yaml" || fail "tunnels.enabled was refused"
grep -q -- '- --insecure-plaintext' "$work/tunnels.yaml" || fail "tunnels: the gateway's plaintext relay runs without --insecure-plaintext"
grep -q -- '--gateway.relay-advertise-addr=$(POD_IP):9444' "$work/tunnels.yaml" || fail "tunnels: the gateway does not advertise its pod IP"
grep -q -- '--api.relay-token-file=/etc/leasehold/relay-token/token' "$work/tunnels.yaml" || fail "tunnels: the api has no relay token"
grep -q 'relay-token' "$work/default.yaml" && fail "tunnels are off by default, yet a relay token is mounted"

echo "== ServiceAccount, image digests, extra volumes"
sa=$(grep -c '^kind: ServiceAccount$' "$work/default.yaml" || true)
[ "$sa" = 2 ] || fail "default values render $sa ServiceAccounts, want the release's and the migration hook's"
pods=$(grep -cE '^ +(serviceAccountName): ' "$work/default.yaml" || true)
tokens=$(grep -cE '^ *automountServiceAccountToken: false$' "$work/default.yaml" || true)
[ "$pods" -ge 6 ] || fail "only $pods pod specs name a serviceAccountName"
[ "$tokens" = $((pods + 2)) ] || fail "automountServiceAccountToken: false on $tokens objects, want every pod spec ($pods) and both ServiceAccounts"
render --set serviceAccount.create=false >"$work/nosa.yaml"
grep -q '^kind: ServiceAccount$' "$work/nosa.yaml" && fail "serviceAccount.create=false still renders a ServiceAccount"
grep -qE '^ +serviceAccountName: default$' "$work/nosa.yaml" || fail "serviceAccount.create=false: pods do not use the default ServiceAccount"
digest=sha256:$(printf '%064d' 7)
render --set "image.digests.gateway=$digest" >"$work/digest.yaml"
grep -qF "image: ghcr.io/leasehold/leasehold-gateway@$digest" "$work/digest.yaml" || fail "image.digests.gateway is not used"
grep -qF 'image: ghcr.io/leasehold/leasehold-api:' "$work/digest.yaml" || fail "an image without a digest lost its tag"
# A PostgreSQL CA for sslmode=verify-full, in every pod of the chart.
render --set-json 'extraVolumes=[{"name":"pg-ca","secret":{"secretName":"leasehold-postgres-ca"}}]' \
	--set-json 'extraVolumeMounts=[{"name":"pg-ca","mountPath":"/etc/leasehold/pg-ca","readOnly":true}]' \
	--set-json 'extraEnv=[{"name":"PGSSLROOTCERT","value":"/etc/leasehold/pg-ca/ca.crt"}]' \
	--set-json 'worker.extraEnv=[{"name":"WORKER_ONLY","value":"1"}]' >"$work/extra.yaml" ||
	fail "extraVolumes/extraVolumeMounts/extraEnv were refused"
n=$(grep -c 'secretName: leasehold-postgres-ca' "$work/extra.yaml" || true)
[ "$n" = 7 ] || fail "the global extraVolumes reached $n pods, want 7 (5 Deployments, the CronJob, the Job)"
n=$(grep -c 'mountPath: /etc/leasehold/pg-ca' "$work/extra.yaml" || true)
[ "$n" = 7 ] || fail "the global extraVolumeMounts reached $n containers, want 7"
n=$(grep -c 'name: PGSSLROOTCERT' "$work/extra.yaml" || true)
[ "$n" = 7 ] || fail "the global extraEnv reached $n containers, want 7"
n=$(grep -c 'name: WORKER_ONLY' "$work/extra.yaml" || true)
[ "$n" = 1 ] || fail "worker.extraEnv reached $n containers, want 1"
echo "ok"

echo "== NetworkPolicies: who reaches whom (tools/k8s/netpolcheck evaluates the rendered policies)"
render >"$work/np-default.yaml"
render -f "$chart/values-ha.yaml" >"$work/np-ha.yaml"
render --set tunnels.enabled=true --set insecurePlaintext=true >"$work/np-tunnels.yaml"
render --set doctor.serve.tls.secretName=leasehold-doctor-tls \
	--set-json 'networkPolicy.ingress.api=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"ingress-nginx"}}}]' \
	--set-json 'networkPolicy.database.to=[{"ipBlock":{"cidr":"192.0.2.0/24"}}]' \
	--set-json 'networkPolicy.extraEgress={"worker":[{"ports":[{"port":443,"protocol":"TCP"}]}]}' >"$work/np-custom.yaml"
render --set networkPolicy.enabled=false >"$work/np-off.yaml"
grep -q '^kind: NetworkPolicy$' "$work/np-off.yaml" && fail "networkPolicy.enabled=false still renders NetworkPolicies"
n=$(grep -c '^kind: NetworkPolicy$' "$work/np-default.yaml" || true)
[ "$n" = 7 ] || fail "default values render $n NetworkPolicies, want 7 (api, gateway, worker, scheduler, doctor, doctor-check, migrate)"
# Endpoints: the chart's components, and monitoring (a pod of namespace
# monitoring), other-ns (a pod of namespace default), same-ns (a foreign pod of
# the release namespace), dns (kube-system), internet, postgres (192.0.2.10).
# A port is a number (/udp for UDP) or a container port name of the destination.
if ! GOWORK=off go -C tools/k8s run ./netpolcheck -render "default=$work/np-default.yaml" -render "ha=$work/np-ha.yaml" \
	-render "tunnels=$work/np-tunnels.yaml" -render "custom=$work/np-custom.yaml" >"$work/np.txt" 2>&1 <<'CASES'
# render  from          to          port     expect
# public ports from anywhere
default   internet      api         connect  allow
default   other-ns      api         connect  allow
default   internet      gateway     nodes    allow
ha        internet      gateway     nodes    allow
ha        internet      api         connect  allow
# the health/metrics port from the monitoring namespace only
default   monitoring    api         health   allow
default   monitoring    gateway     health   allow
default   monitoring    worker      health   allow
default   monitoring    scheduler   health   allow
default   monitoring    doctor      health   allow
default   other-ns      worker      health   deny
default   same-ns       scheduler   health   deny
default   internet      gateway     health   deny
default   api           worker      health   deny
ha        other-ns      gateway     health   deny
ha        monitoring    gateway     health   allow
# jobs accept nothing
default   monitoring    doctor-check 9100    deny
default   same-ns       migrate     9100     deny
# DoctorService on loopback by default: no port to reach
default   other-ns      doctor      8080     deny
default   monitoring    doctor      8080     deny
# the relay: off by default; with tunnels from the api pods only
default   api           gateway     9444     deny
ha        api           gateway     9444     deny
tunnels   api           gateway     relay    allow
tunnels   api           gateway     9444     allow
tunnels   worker        gateway     9444     deny
tunnels   scheduler     gateway     9444     deny
tunnels   doctor        gateway     9444     deny
tunnels   same-ns       gateway     9444     deny
tunnels   other-ns      gateway     9444     deny
tunnels   internet      gateway     9444     deny
tunnels   api           worker      9444     deny
tunnels   api           gateway     health   deny
# egress: PostgreSQL and DNS, nothing else
default   worker        postgres    5432     allow
default   scheduler     postgres    5432     allow
default   gateway       postgres    5432     allow
default   api           postgres    5432     allow
default   doctor        postgres    5432     allow
default   doctor-check  postgres    5432     allow
default   migrate       postgres    5432     allow
default   worker        postgres    6432     deny
ha        worker        postgres    6432     allow
ha        migrate       postgres    5432     allow
default   worker        dns         53/udp   allow
default   api           dns         53       allow
default   migrate       dns         53/udp   allow
default   worker        other-ns    53/udp   deny
default   worker        internet    443      deny
default   gateway       internet    443      deny
default   api           internet    443      deny
default   worker        gateway     nodes    deny
default   api           gateway     nodes    deny
default   scheduler     api         connect  deny
default   doctor        api         connect  deny
# configured: api from ingress-nginx only, PostgreSQL by CIDR, DoctorService over TLS, a worker webhook egress
custom    other-ns      api         connect  deny
custom    internet      api         connect  deny
custom    other-ns      doctor      connect  allow
custom    worker        postgres    5432     allow
custom    worker        internet    5432     deny
custom    worker        internet    443      allow
custom    scheduler     internet    443      deny
CASES
then
	cat "$work/np.txt" >&2
	fail "NetworkPolicy cases (above)"
else
	echo "ok ($(grep -c '^ok' "$work/np.txt") connections as expected)"
fi

echo "== monitoring objects follow the cluster's APIs"
mon=(--api-versions monitoring.coreos.com/v1/ServiceMonitor --api-versions monitoring.coreos.com/v1/PrometheusRule)
kinds "$work/default.yaml" >"$work/kinds"
if grep -qE '^(ServiceMonitor|PrometheusRule)$' "$work/kinds"; then
	fail "ServiceMonitor/PrometheusRule rendered without monitoring.coreos.com/v1"
fi
render "${mon[@]}" >"$work/mon.yaml"
kinds "$work/mon.yaml" >"$work/kinds"
grep -qx ServiceMonitor "$work/kinds" || fail "no ServiceMonitor with monitoring.coreos.com/v1/ServiceMonitor served"
grep -qx PrometheusRule "$work/kinds" || fail "no PrometheusRule with monitoring.coreos.com/v1/PrometheusRule served"
render --api-versions monitoring.coreos.com/v1/ServiceMonitor >"$work/sm.yaml"
kinds "$work/sm.yaml" >"$work/kinds"
grep -qx ServiceMonitor "$work/kinds" || fail "no ServiceMonitor with only ServiceMonitor served"
grep -qx PrometheusRule "$work/kinds" && fail "PrometheusRule rendered on a cluster serving only ServiceMonitor"
render "${mon[@]}" --set metrics.serviceMonitor.enabled=false --set metrics.prometheusRule.enabled=false >"$work/off.yaml"
kinds "$work/off.yaml" >"$work/kinds"
grep -qE '^(ServiceMonitor|PrometheusRule)$' "$work/kinds" && fail "monitoring objects rendered with their switches off"
echo "ok"

echo "== NOTES.txt says what was installed and how to reach it"
helm install leasehold "$chart" --namespace leasehold --dry-run=client >"$work/notes.txt"
for want in 'gateway: Deployment leasehold-gateway' 'leasehold-gateway.leasehold.svc:443' \
	'no ServiceMonitor' 'port-forward service/leasehold-api' 'ControlService/ListNodes' \
	'leasehold-api-tls: the api' 'leasehold-gateway-tls: the gateway' 'port-forward deployment/leasehold-doctor'; do
	grep -qF "$want" "$work/notes.txt" || fail "NOTES.txt lacks: $want"
done
echo "ok"

echo "== Grafana dashboard ConfigMap"
cmp -s deploy/grafana/leasehold.json "$chart/dashboards/leasehold.json" ||
	fail "deploy/helm/leasehold/dashboards/leasehold.json differs from deploy/grafana/leasehold.json: cp deploy/grafana/leasehold.json deploy/helm/leasehold/dashboards/"
render --show-only templates/grafana-dashboard.yaml >"$work/cm.yaml"
grep -q '^    grafana_dashboard: "1"$' "$work/cm.yaml" || fail "dashboard ConfigMap lacks the label grafana_dashboard: \"1\""
# The data block is the file indented by four spaces.
awk '/^  leasehold.json: \|-$/ {on=1; next} on && /^    / {print substr($0, 5); next} on && /^$/ {print; next} on {exit}' \
	"$work/cm.yaml" >"$work/dashboard.json"
# (-B: the block's trailing blank lines are YAML's, not the file's)
diff -q -B <(sed -e '$a\' deploy/grafana/leasehold.json) "$work/dashboard.json" >/dev/null ||
	fail "the ConfigMap's leasehold.json is not deploy/grafana/leasehold.json"
echo "ok"

echo "== every runbook_url names an anchor of docs/runbooks.md"
# GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens.
grep -E '^#+ ' docs/runbooks.md | sed -E 's/^#+ //' | tr 'A-Z' 'a-z' |
	sed -E 's/[^a-z0-9 _-]//g; s/ /-/g' | sort -u >"$work/anchors"
grep -E '^ +runbook_url: ' "$work/mon.yaml" | sed -E 's/.*runbook_url: //' | sort -u >"$work/urls"
[ -s "$work/urls" ] || fail "no alert has a runbook_url"
grep -qE '^ +runbook: ' "$work/mon.yaml" && fail "an alert still has the annotation runbook: (use runbook_url)"
alerts=$(grep -cE '^ +- alert: ' "$work/mon.yaml")
with_url=$(grep -cE '^ +runbook_url: ' "$work/mon.yaml")
[ "$alerts" = "$with_url" ] || fail "$alerts alerts but $with_url runbook_url annotations"
while read -r url; do
	anchor=${url##*#}
	grep -qx -- "$anchor" "$work/anchors" || fail "runbook_url $url: docs/runbooks.md has no heading #$anchor"
done <"$work/urls"
for a in LeaseholdCertificateExpiringSoon LeaseholdCertificateExpiryCritical LeaseholdConfigReloadFailing; do
	grep -qE "^ +- alert: $a$" "$work/mon.yaml" || fail "no alert $a"
done
if render "${mon[@]}" --set metrics.prometheusRule.certExpiryCriticalDays=30 >/dev/null 2>"$work/err"; then
	fail "certExpiryCriticalDays above certExpiryWarningDays rendered"
fi
echo "ok ($alerts alerts)"

if [ "$failures" -gt 0 ]; then
	echo "$failures chart check(s) failed" >&2
	exit 1
fi
echo "all chart checks passed"
