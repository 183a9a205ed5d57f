{{/* Names */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
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

{{/* Name of one component's objects: FULLNAME-COMPONENT (capped so the suffix survives). */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root | trunc 52 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one component (router, prefill, decode): dict "root" $ "component" NAME. */}}
{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.componentSelectorLabels" -}}
{{ include "tandem.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The label selector the router watches for one worker role (EndpointSlices carry
     their Service's labels), scoped to this release. */}}
{{- define "tandem.workerSelector" -}}
{{- printf "app.kubernetes.io/component=%s,app.kubernetes.io/instance=%s,app.kubernetes.io/name=%s" .component .root.Release.Name (include "tandem.name" .root) -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "router")) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.configName" -}}
{{- include "tandem.componentName" (dict "root" . "component" "config") -}}
{{- end -}}

{{- define "tandem.clusterSecretName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "cluster")) .Values.clusterSecret.existingSecret -}}
{{- end -}}

{{/* Args every service gets for the cluster secret. */}}
{{- define "tandem.clusterSecretArgs" -}}
- --cluster-secret-file=/etc/tandem/cluster/{{ .Values.clusterSecret.secretKey }}
{{- end -}}

{{- define "tandem.authSecretName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "auth")) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "tandem.metricsKeySecretName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "metrics-key")) .Values.metrics.key.existingSecret -}}
{{- end -}}

{{/* A monitor endpoint's bearer token: the metrics key, when there is one. */}}
{{- define "tandem.metricsBearer" -}}
{{- if .Values.metrics.key.enabled }}
bearerTokenSecret:
  name: {{ include "tandem.metricsKeySecretName" . }}
  key: {{ .Values.metrics.key.secretKey }}
{{- end }}
{{- end -}}

{{/* The value a created Secret keeps across upgrades: key "key" of the release's Secret
     "name" when it exists, else "length" random characters.
     dict "root" $ "name" SECRET "key" KEY "length" N */}}
{{- define "tandem.keptRandom" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $existing (hasKey (default dict $existing.data) .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum .length -}}
{{- end -}}
{{- end -}}

{{/* Image of a pod; gpu=true picks the CUDA tag. dict "root" $ "gpu" BOOL */}}
{{- define "tandem.image" -}}
{{- $img := .root.Values.image -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- if .gpu }}{{ $tag = printf "%s%s" $tag $img.gpuTagSuffix }}{{ end -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}

{{- define "tandem.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.file -}}
{{- end -}}

{{- define "tandem.modelClaimName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "models")) .Values.model.persistence.existingClaim -}}
{{- end -}}

{{/* Pod annotations that roll pods when the shared config (or created secret) changes. */}}
{{- define "tandem.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) }}
checksum/auth: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- end -}}

{{/* Env every container gets besides the ConfigMap. */}}
{{- define "tandem.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* The model init container (none when model.source is none). */}}
{{- define "tandem.modelInitContainer" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "fetch" }}
- name: fetch-model
  image: {{ include "tandem.image" (dict "root" . "gpu" false) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- /* flock: pods sharing one claim fetch one at a time; the others find the file. */}}
  command: ["flock", "{{ trimSuffix "/" $m.mountPath }}/.fetch-model.lock", "tandem"]
  args: ["fetch-model", "--cache-dir", {{ $m.mountPath | quote }}, "--quiet"]
  env:
    - name: HOME
      value: /tmp
    - name: PIP_NO_CACHE_DIR
      value: "1"
    {{- with $m.fetch.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.fetch.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: models
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- else if eq $m.source "image" }}
- name: copy-model
  image: {{ if $m.image.repository }}{{ printf "%s:%s" $m.image.repository (default .Chart.AppVersion $m.image.tag) }}{{ else }}{{ include "tandem.image" (dict "root" . "gpu" false) }}{{ end }}
  imagePullPolicy: {{ $m.image.pullPolicy }}
  command: ["cp", "-R", "{{ trimSuffix "/" $m.image.path }}/.", {{ $m.mountPath | quote }}]
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: models
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}

{{/* Volumes every pod has: the model, /tmp (HOME). */}}
{{- define "tandem.commonVolumes" -}}
- name: models
{{- if .Values.model.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "tandem.modelClaimName" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.emptyDirSizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
- name: cluster-secret
  secret:
    secretName: {{ include "tandem.clusterSecretName" . }}
    defaultMode: 0400
{{- end -}}

{{/* Deployment strategy: the pool's, else a surge-first rolling update. */}}
{{- define "tandem.strategy" -}}
{{- if . }}
{{- toYaml . }}
{{- else }}
type: RollingUpdate
rollingUpdate:
  maxSurge: 1
  maxUnavailable: 0
{{- end }}
{{- end -}}

{{/* Probe timing fields of one probe block. */}}
{{- define "tandem.probeTiming" -}}
{{- range $k := list "initialDelaySeconds" "periodSeconds" "timeoutSeconds" "failureThreshold" "successThreshold" }}
{{- if hasKey $ $k }}
{{ $k }}: {{ get $ $k }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget spec body from pdb values: minAvailable wins when set. */}}
{{- define "tandem.pdbBudget" -}}
{{- if not (kindIs "invalid" .minAvailable) }}
minAvailable: {{ .minAvailable }}
{{- else if not (kindIs "invalid" .maxUnavailable) }}
maxUnavailable: {{ .maxUnavailable }}
{{- else }}
maxUnavailable: 1
{{- end }}
{{- end -}}
