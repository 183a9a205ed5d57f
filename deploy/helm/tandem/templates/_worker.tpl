{{/* A worker pool Deployment: dict "root" $ "component" "prefill"|"decode" */}}
{{- define "tandem.workerDeployment" -}}
{{- $root := .root -}}
{{- $role := .component -}}
{{- $p := index $root.Values $role -}}
{{- $w := $root.Values.workers -}}
{{- $ctx := dict "root" $root "component" $role -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.componentName" $ctx }}
  labels:
    {{- include "tandem.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if not $p.autoscaling.enabled }}
  replicas: {{ $p.replicas }}
  {{- end }}
  strategy:
    {{- include "tandem.strategy" $p.strategy | trim | nindent 4 }}
  selector:
    matchLabels:
      {{- include "tandem.componentSelectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.componentLabels" $ctx | nindent 8 }}
        {{- with $p.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "tandem.checksums" $root | nindent 8 }}
        {{- with $p.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ $p.terminationGracePeriodSeconds }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "tandem.modelInitContainer" $root | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "tandem.image" (dict "root" $root "gpu" $p.gpu.enabled) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem"]
          args:
            - --log-level=$(TANDEM_LOG_LEVEL)
            - {{ $role }}
            - --host={{ default "$(POD_IP)" $w.bindAddress }}
            - --port={{ $w.grpcPort }}
            - --metrics-port={{ $w.metricsPort }}
            - --worker-id=$(POD_NAME)
            - --drain-timeout-s={{ max 0 (sub (int $p.terminationGracePeriodSeconds) (add (int $p.preStopSleepSeconds) 5)) }}
            - --model=$(TANDEM_MODEL)
            - --kv-transfer=$(TANDEM_KV_TRANSFER)
            - --dtype=$(TANDEM_DTYPE)
            - --kv-cache-dtype=$(TANDEM_KV_CACHE_DTYPE)
            - --block-size=$(TANDEM_BLOCK_SIZE)
            - --hash-seed=$(TANDEM_HASH_SEED)
            {{- include "tandem.clusterSecretArgs" $root | nindent 12 }}
            {{- if $p.gpu.enabled }}
            - --device=cuda
            {{- end }}
            {{- if not (kindIs "invalid" $p.kvBlocks) }}
            - --kv-blocks={{ $p.kvBlocks | int64 }}
            {{- end }}
            {{- if not (kindIs "invalid" $p.kvCacheMemoryGib) }}
            - --kv-cache-memory-gib={{ $p.kvCacheMemoryGib }}
            {{- end }}
            {{- if not (kindIs "invalid" $p.maxNumSeqs) }}
            - --max-num-seqs={{ $p.maxNumSeqs | int64 }}
            {{- end }}
            {{- if not (kindIs "invalid" $p.maxNumBatchedTokens) }}
            - --max-num-batched-tokens={{ $p.maxNumBatchedTokens | int64 }}
            {{- end }}
            {{- if and (hasKey $p "leaseTtlSeconds") (not (kindIs "invalid" $p.leaseTtlSeconds)) }}
            - --lease-ttl-s={{ $p.leaseTtlSeconds }}
            {{- end }}
            {{- if and (hasKey $p "transferTimeoutSeconds") (not (kindIs "invalid" $p.transferTimeoutSeconds)) }}
            - --transfer-timeout-s={{ $p.transferTimeoutSeconds }}
            {{- end }}
            {{- range $p.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "tandem.configName" $root }}
          env:
            {{- include "tandem.podEnv" $root | nindent 12 }}
            - name: HOME
              value: /tmp
            {{- with $p.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $w.grpcPort }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $w.metricsPort }}
              protocol: TCP
          {{- /* Native gRPC probes: the workers serve grpc.health.v1.Health. */}}
          startupProbe:
            grpc:
              port: {{ $w.grpcPort }}
            {{- include "tandem.probeTiming" $w.probes.startup | trim | nindent 12 }}
          readinessProbe:
            grpc:
              port: {{ $w.grpcPort }}
            {{- include "tandem.probeTiming" $w.probes.readiness | trim | nindent 12 }}
          livenessProbe:
            grpc:
              port: {{ $w.grpcPort }}
            {{- include "tandem.probeTiming" $w.probes.liveness | trim | nindent 12 }}
          lifecycle:
            preStop:
              exec:
                command: ["sleep", "{{ $p.preStopSleepSeconds }}"]
          {{- $res := deepCopy (default dict $p.resources) }}
          {{- if $p.gpu.enabled }}
          {{- $limits := default dict $res.limits }}
          {{- $_ := set $limits $p.gpu.resourceName $p.gpu.count }}
          {{- $_ := set $res "limits" $limits }}
          {{- end }}
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: models
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            - name: tmp
              mountPath: /tmp
            - name: dshm
              mountPath: /dev/shm
            - name: cluster-secret
              mountPath: /etc/tandem/cluster
              readOnly: true
            {{- with $p.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "tandem.commonVolumes" $root | nindent 8 }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $w.shmSizeLimit }}
        {{- with $p.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $p.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* A worker pool Service (headless by default), labelled with the component the router
     selects on, port named grpc. dict "root" $ "component" ROLE */}}
{{- define "tandem.workerService" -}}
{{- $root := .root -}}
{{- $p := index $root.Values .component -}}
{{- $w := $root.Values.workers -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
  {{- with $p.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: ClusterIP
  {{- if $p.service.headless }}
  clusterIP: None
  {{- end }}
  publishNotReadyAddresses: false
  selector:
    {{- include "tandem.componentSelectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $w.grpcPort }}
      targetPort: grpc
      protocol: TCP
      appProtocol: kubernetes.io/h2c
    - name: metrics
      port: {{ $w.metricsPort }}
      targetPort: metrics
      protocol: TCP
{{- end -}}

{{/* A PodDisruptionBudget of one component. dict "root" $ "component" NAME */}}
{{- define "tandem.pdb" -}}
{{- $p := index .root.Values .component -}}
{{- if $p.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
spec:
  {{- include "tandem.pdbBudget" $p.pdb | trim | nindent 2 }}
  selector:
    matchLabels:
      {{- include "tandem.componentSelectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}
