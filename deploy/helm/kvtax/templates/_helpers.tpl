{{/* Shared pieces of kvtax's chart. */}}

{{- define "kvtax.labels" -}}
app.kubernetes.io/part-of: kvtax
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of the monitoring objects: the chart's, release: for kube-prometheus-stack, extras. */}}
{{- define "kvtax.monitoringLabels" -}}
{{ include "kvtax.labels" . }}
app.kubernetes.io/name: kvtax
{{- with .Values.monitoring.release }}
release: {{ . | quote }}
{{- end }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvtax.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{- define "kvtax.workloadName" -}}
{{- $d := .Values.workload.deployment | default dict -}}
{{- $meta := $d.metadata | default dict -}}
{{- required "workload.deployment.metadata.name: name the vLLM Deployment kvtax joins" $meta.name -}}
{{- end -}}

{{- define "kvtax.serviceName" -}}
{{- .Values.service.name | default (include "kvtax.workloadName" .) -}}
{{- end -}}

{{/* The kvtax container; observe-only as a native sidecar adds restartPolicy: Always. */}}
{{- define "kvtax.container" -}}
{{- $proxy := .Values.kvtax.proxy.enabled -}}
name: kvtax
image: {{ include "kvtax.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- if and (not $proxy) .Values.kvtax.nativeSidecar }}
restartPolicy: Always
{{- end }}
args:
  - serve
  - --vllm.url=http://127.0.0.1:{{ .Values.kvtax.vllmPort }}
  - --web.listen-address=:{{ .Values.kvtax.port }}
  {{- if $proxy }}
  - --proxy.listen-address=:{{ .Values.kvtax.proxy.port }}
  - --proxy.workers={{ .Values.kvtax.proxy.workers }}
  {{- else }}
  - --proxy.listen-address=off
  {{- end }}
  - --max-num-seqs={{ .Values.kvtax.maxNumSeqs }}
  {{- range .Values.kvtax.extraArgs }}
  - {{ . | quote }}
  {{- end }}
{{- with .Values.kvtax.extraEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
ports:
  - name: kvtax-metrics
    containerPort: {{ .Values.kvtax.port }}
  {{- if $proxy }}
  - name: kvtax-proxy
    containerPort: {{ .Values.kvtax.proxy.port }}
  {{- end }}
livenessProbe:
  # Answers while the process serves, whether or not vLLM is up: restarts kvtax only.
  httpGet:
    path: /healthz
    port: kvtax-metrics
  periodSeconds: 10
  failureThreshold: 3
{{- if $proxy }}
readinessProbe:
  # Clients reach vLLM through this container: ready means the proxy can serve.
  httpGet:
    path: /readyz
    port: kvtax-metrics
  periodSeconds: 5
  failureThreshold: 2
{{- end }}
resources:
  {{- toYaml .Values.kvtax.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.kvtax.securityContext | nindent 2 }}
volumeMounts:
  - name: kvtax-tmp
    mountPath: /tmp
{{- end -}}

{{/* The init container that copies the plugin folder out of the kvtax image. */}}
{{- define "kvtax.pluginInitContainer" -}}
name: kvtax-plugin
image: {{ include "kvtax.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
# The image's Python copies its plugin folder; no shell needed.
command:
  - python
  - -c
  - import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True)
  - {{ .Values.plugin.imagePath }}
  - /kvtax-plugin
resources:
  {{- toYaml .Values.plugin.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.kvtax.securityContext | nindent 2 }}
volumeMounts:
  - name: kvtax-plugin
    mountPath: /kvtax-plugin
{{- end -}}
