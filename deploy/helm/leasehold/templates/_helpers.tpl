{{/* Names ---------------------------------------------------------------- */}}

{{- define "leasehold.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "leasehold.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* leasehold.componentName: <fullname>-<component>, e.g. leasehold-gateway. */}}
{{- define "leasehold.componentName" -}}
{{- printf "%s-%s" (include "leasehold.fullname" .ctx) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "leasehold.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "leasehold.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: leasehold
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "leasehold.selectorLabels" -}}
app.kubernetes.io/name: {{ include "leasehold.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* leasehold.image: dict ctx, service. */}}
{{- define "leasehold.image" -}}
{{- $img := .ctx.Values.image -}}
{{- $repo := printf "%s%s" $img.repositoryPrefix .service -}}
{{- if $img.registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" $img.registry) $repo }}{{ end -}}
{{- $digest := get (default (dict) $img.digests) .service -}}
{{- if $digest -}}
{{- printf "%s@%s" $repo $digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* leasehold.serviceAccountName: the pods' ServiceAccount. */}}
{{- define "leasehold.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "leasehold.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* leasehold.migrateServiceAccountName: the migration Job's ServiceAccount.
     A pre-install hook runs before the release's own objects exist, so with
     serviceAccount.create the Job gets a hook ServiceAccount of its own. */}}
{{- define "leasehold.migrateServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- printf "%s-migrate" (include "leasehold.serviceAccountName" .) | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- include "leasehold.serviceAccountName" . -}}
{{- end -}}
{{- end -}}

{{/* leasehold.merge: dict base (YAML list text, may be empty), global and
     own (lists from values): one YAML list text, base first. For volumes,
     volumeMounts and env: the chart's own, then extraX, then <component>.extraX. */}}
{{- define "leasehold.merge" -}}
{{- $parts := list -}}
{{- with .base }}{{ $parts = append $parts (trim .) }}{{ end -}}
{{- with .global }}{{ $parts = append $parts (toYaml . | trim) }}{{ end -}}
{{- with .own }}{{ $parts = append $parts (toYaml . | trim) }}{{ end -}}
{{- join "\n" $parts -}}
{{- end -}}

{{/* Monitoring ----------------------------------------------------------- */}}

{{/* leasehold.monitoring: dict ctx, kind (ServiceMonitor or PrometheusRule).
     "true" when the values switch is on AND the cluster serves that kind of
     monitoring.coreos.com/v1 (prometheus-operator's CRD is installed), so an
     install on a cluster without the operator never fails on a missing CRD.
     With `helm template`, pass --api-versions monitoring.coreos.com/v1/<kind>. */}}
{{- define "leasehold.monitoring" -}}
{{- $switch := dict "ServiceMonitor" .ctx.Values.metrics.serviceMonitor.enabled "PrometheusRule" .ctx.Values.metrics.prometheusRule.enabled -}}
{{- and (get $switch .kind) (.ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind)) -}}
{{- end -}}

{{/* Durations ------------------------------------------------------------ */}}

{{/* leasehold.ms: a one-unit Go duration ("15s", "500ms", "10m", "2h") in
     milliseconds; anything else fails the render naming the value. */}}
{{- define "leasehold.ms" -}}
{{- $d := toString . -}}
{{- if regexMatch "^[0-9]+ms$" $d -}}{{ trimSuffix "ms" $d | int64 }}
{{- else if regexMatch "^[0-9]+s$" $d -}}{{ mul (trimSuffix "s" $d | int64) 1000 }}
{{- else if regexMatch "^[0-9]+m$" $d -}}{{ mul (trimSuffix "m" $d | int64) 60000 }}
{{- else if regexMatch "^[0-9]+h$" $d -}}{{ mul (trimSuffix "h" $d | int64) 3600000 }}
{{- else -}}{{ fail (printf "duration %q: use one unit, e.g. 15s, 500ms, 10m, 168h" $d) }}
{{- end -}}
{{- end -}}

{{/* Database and secrets ------------------------------------------------- */}}

{{- define "leasehold.databaseSecret" -}}
{{- if .Values.database.existingSecret -}}
{{- .Values.database.existingSecret -}}
{{- else -}}
{{- printf "%s-database" (include "leasehold.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* leasehold.env: the environment every long-running process gets. */}}
{{- define "leasehold.env" -}}
- name: LEASEHOLD_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "leasehold.databaseSecret" . }}
      key: {{ .Values.database.urlKey }}
- name: LEASEHOLD_LISTEN_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "leasehold.databaseSecret" . }}
      key: {{ .Values.database.directUrlKey }}
      optional: true
{{- if .Values.healthToken.existingSecret }}
- name: LEASEHOLD_HEALTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.healthToken.existingSecret }}
      key: {{ .Values.healthToken.key }}
{{- end }}
{{- end -}}

{{/* leasehold.commonArgs: dict ctx, values (the component's), maxConns. */}}
{{- define "leasehold.commonArgs" -}}
- --http-addr=0.0.0.0:9100
- --log-level={{ .ctx.Values.log.level }}
- --log-format={{ .ctx.Values.log.format }}
- --db-max-conns={{ default .ctx.Values.database.maxConns .maxConns }}
- --shutdown-timeout={{ .values.shutdownTimeout }}
{{- if .ctx.Values.database.pooler }}
- --pooler
{{- end }}
{{- end -}}

{{- define "leasehold.coordArgs" -}}
{{- $c := .Values.coord -}}
- --coord.lease-ttl={{ $c.leaseTTL }}
- --coord.renew-interval={{ $c.renewInterval }}
- --coord.live-window={{ $c.liveWindow }}
- --coord.forget-after={{ $c.forgetAfter }}
- --coord.claim-ttl={{ $c.claimTTL }}
- --coord.claim-batch={{ $c.claimBatch }}
- --coord.poll-interval={{ $c.pollInterval }}
- --coord.self-release-after={{ $c.selfReleaseAfter }}
- --coord.statement-timeout={{ $c.statementTimeout }}
{{- end -}}

{{/* leasehold.doctorArgs: the thresholds doctor check and serve share. */}}
{{- define "leasehold.doctorArgs" -}}
{{- $v := .Values -}}
- --lease-ttl={{ $v.coord.leaseTTL }}
- --live-window={{ $v.coord.liveWindow }}
- --queue-overdue={{ $v.doctor.queueOverdue }}
- --max-streams={{ $v.gateway.maxStreams }}
- --expect-pool-size={{ $v.database.maxConns }}
{{- if $v.worker.enabled }}
- --expect-workers={{ $v.worker.replicas }}
{{- end }}
{{- if $v.scheduler.enabled }}
- --expect-schedulers={{ $v.scheduler.replicas }}
{{- end }}
{{- if $v.gateway.enabled }}
- --expect-gateways={{ $v.gateway.replicas }}
{{- end }}
{{- if $v.api.enabled }}
- --expect-api={{ $v.api.replicas }}
{{- end }}
{{- if $v.doctor.regions }}
- --regions={{ $v.doctor.regions }}
{{- end }}
{{- with (include "leasehold.doctorCerts" . | fromYaml).files }}
- --tls-cert-files={{ join "," . }}
{{- end }}
{{- end -}}

{{/* leasehold.doctorCerts: the certificates doctor's tls.expiry reads, as
     YAML {files, mounts, volumes}: the public certificate (tls.crt, ca.crt;
     never a key) of each TLS Secret the values configure, mounted read-only
     whole-Secret (no subPath, so renewals show) under /etc/leasehold/certs. */}}
{{- define "leasehold.doctorCerts" -}}
{{- $v := .Values -}}
{{- $certs := list -}}
{{- if and $v.api.enabled $v.api.tls.secretName -}}
{{- $certs = append $certs (dict "name" "api" "secret" $v.api.tls.secretName "key" "tls.crt") -}}
{{- end -}}
{{- if and $v.gateway.enabled $v.gateway.tls.secretName -}}
{{- $certs = append $certs (dict "name" "gateway" "secret" $v.gateway.tls.secretName "key" "tls.crt") -}}
{{- with $v.gateway.tls.clientCASecretName -}}
{{- $certs = append $certs (dict "name" "gateway-client-ca" "secret" . "key" "ca.crt") -}}
{{- end -}}
{{- end -}}
{{- if and $v.tunnels.enabled $v.tunnels.relayTLS.enabled -}}
{{- if $v.gateway.enabled -}}
{{- $certs = append $certs (dict "name" "relay" "secret" $v.tunnels.relayTLS.serverSecretName "key" "tls.crt") -}}
{{- end -}}
{{- if $v.api.enabled -}}
{{- $certs = append $certs (dict "name" "relay-client" "secret" $v.tunnels.relayTLS.clientSecretName "key" "tls.crt") -}}
{{- end -}}
{{- end -}}
{{- if and $v.doctor.serve.enabled $v.doctor.serve.tls.secretName -}}
{{- $certs = append $certs (dict "name" "doctor" "secret" $v.doctor.serve.tls.secretName "key" "tls.crt") -}}
{{- end -}}
{{- $files := list -}}
{{- $mounts := list -}}
{{- $volumes := list -}}
{{- range $certs -}}
{{- $dir := printf "/etc/leasehold/certs/%s" .name -}}
{{- $files = append $files (printf "%s/%s" $dir .key) -}}
{{- $mounts = append $mounts (dict "name" (printf "cert-%s" .name) "mountPath" $dir "readOnly" true) -}}
{{- $volumes = append $volumes (dict "name" (printf "cert-%s" .name) "secret" (dict "secretName" .secret "items" (list (dict "key" .key "path" .key)))) -}}
{{- end -}}
{{- toYaml (dict "files" $files "mounts" $mounts "volumes" $volumes) -}}
{{- end -}}

{{/* leasehold.npPublic: dict port (a container port name), from (peers;
     empty: from anywhere): a NetworkPolicy ingress rule as YAML. */}}
{{- define "leasehold.npPublic" -}}
{{- $r := dict "ports" (list (dict "port" .port "protocol" "TCP")) -}}
{{- with .from }}{{ $_ := set $r "from" . }}{{ end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* Pod pieces ----------------------------------------------------------- */}}

{{- define "leasehold.probes" -}}
{{- $p := .Values.probes -}}
livenessProbe:
  httpGet:
    path: /livez
    port: health
  initialDelaySeconds: {{ $p.liveness.initialDelaySeconds }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: health
  initialDelaySeconds: {{ $p.readiness.initialDelaySeconds }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- end -}}

{{/* leasehold.topologySpread: dict ctx, component. */}}
{{- define "leasehold.topologySpread" -}}
{{- $ctx := .ctx -}}
{{- $component := .component -}}
{{- range .ctx.Values.topologySpread }}
- maxSkew: {{ .maxSkew }}
  topologyKey: {{ .topologyKey }}
  whenUnsatisfiable: {{ .whenUnsatisfiable }}
  labelSelector:
    matchLabels:
      {{- include "leasehold.selectorLabels" (dict "ctx" $ctx "component" $component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* leasehold.deployment: the Deployment of one long-running component.
     dict ctx, component, service (binary name), values, args, ports,
     volumes, volumeMounts, env. */}}
{{- define "leasehold.deployment" -}}
{{- $ctx := .ctx -}}
{{- $v := .values -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "leasehold.componentName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "leasehold.labels" . | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "leasehold.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "leasehold.labels" . | nindent 8 }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $ctx.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      serviceAccountName: {{ include "leasehold.serviceAccountName" $ctx }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $ctx.Values.podSecurityContext | nindent 8 }}
      topologySpreadConstraints:
        {{- include "leasehold.topologySpread" . | trim | nindent 8 }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .service }}
          image: {{ include "leasehold.image" (dict "ctx" $ctx "service" .service) }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          args:
            {{- .args | nindent 12 }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- include "leasehold.env" $ctx | nindent 12 }}
            {{- with include "leasehold.merge" (dict "base" .env "global" $ctx.Values.extraEnv "own" $v.extraEnv) }}
            {{- . | nindent 12 }}
            {{- end }}
          ports:
            - name: health
              containerPort: 9100
              protocol: TCP
            {{- with .ports }}
            {{- . | nindent 12 }}
            {{- end }}
          {{- include "leasehold.probes" $ctx | nindent 10 }}
          {{- if gt (int $v.preStopSleepSeconds) 0 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $v.preStopSleepSeconds }}
          {{- end }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- toYaml $ctx.Values.securityContext | nindent 12 }}
          {{- with include "leasehold.merge" (dict "base" .volumeMounts "global" $ctx.Values.extraVolumeMounts "own" $v.extraVolumeMounts) }}
          volumeMounts:
            {{- . | nindent 12 }}
          {{- end }}
      {{- with include "leasehold.merge" (dict "base" .volumes "global" $ctx.Values.extraVolumes "own" $v.extraVolumes) }}
      volumes:
        {{- . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* leasehold.metricsService: a headless Service per component that the
     ServiceMonitor scrapes (every pod's :9100/metrics). */}}
{{- define "leasehold.metricsService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "leasehold.componentName" . }}-metrics
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "leasehold.labels" . | nindent 4 }}
    leasehold.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "leasehold.selectorLabels" . | nindent 4 }}
  ports:
    - name: metrics
      port: 9100
      targetPort: health
      protocol: TCP
{{- end -}}

{{/* leasehold.pdb: dict ctx, component, values. */}}
{{- define "leasehold.pdb" -}}
{{- $pdb := .values.podDisruptionBudget -}}
{{- if $pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "leasehold.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "leasehold.labels" . | nindent 4 }}
spec:
  {{- if hasKey $pdb "minAvailable" }}
  minAvailable: {{ $pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $pdb.maxUnavailable }}
  {{- end }}
  unhealthyPodEvictionPolicy: AlwaysAllow
  selector:
    matchLabels:
      {{- include "leasehold.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}
