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
    {{- include "tandem.workerPod" (dict "root" $root "component" $role "follower" false) | nindent 4 }}
{{- end -}}

{{/* How a pool's tensor-parallel group is laid out, as YAML: size (ranks), gpus (GPUs
     per pod), lws (true: a LeaderWorkerSet of size/gpus pods). A group that fits one
     node's GPUs (gpusPerNode) runs in one pod of a Deployment. dict "root" $ "component" ROLE */}}
{{- define "tandem.tpLayout" -}}
{{- $p := index .root.Values .component -}}
{{- $tp := int $p.tensorParallelSize -}}
{{- $perNode := int $p.gpusPerNode -}}
{{- $lws := and $p.gpu.enabled (gt $tp $perNode) -}}
{{- if and $lws (ne (mod $tp $perNode) 0) -}}
{{- fail (printf "%s.tensorParallelSize %d must be a multiple of %s.gpusPerNode %d (each pod of its LeaderWorkerSet holds gpusPerNode ranks)" .component $tp .component $perNode) -}}
{{- end -}}
{{- if and $lws $p.autoscaling.enabled -}}
{{- fail (printf "%s.autoscaling.enabled is not supported for a LeaderWorkerSet pool (%s.tensorParallelSize %d > %s.gpusPerNode %d)" .component .component $tp .component $perNode) -}}
{{- end -}}
size: {{ $tp }}
gpus: {{ if $lws }}{{ $perNode }}{{ else if gt $tp 1 }}{{ $tp }}{{ else }}{{ $p.gpu.count }}{{ end }}
lws: {{ $lws }}
{{- end -}}

{{/* A worker pod template (metadata + spec): dict "root" $ "component" ROLE
     "follower" BOOL. The follower pod of a LeaderWorkerSet runs `tandem tp-follower`
     (the ranks of one node) instead of the gRPC worker, with no ports or probes. */}}
{{- define "tandem.workerPod" -}}
{{- $root := .root -}}
{{- $role := .component -}}
{{- $follower := .follower -}}
{{- $p := index $root.Values $role -}}
{{- $w := $root.Values.workers -}}
{{- $tpv := $w.tensorParallel -}}
{{- $ctx := dict "root" $root "component" $role -}}
{{- $layout := include "tandem.tpLayout" $ctx | fromYaml -}}
metadata:
  labels:
    {{- include "tandem.componentLabels" $ctx | nindent 4 }}
    {{- with $p.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "tandem.checksums" $root | nindent 4 }}
    {{- with $p.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ $p.terminationGracePeriodSeconds }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (include "tandem.modelInitContainer" $root | trim) }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    {{- if $follower }}
    - name: {{ $role }}-ranks
      image: {{ include "tandem.image" (dict "root" $root "gpu" $p.gpu.enabled) }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["tandem"]
      {{- /* LWS sets LWS_LEADER_ADDRESS and LWS_WORKER_INDEX in every container. */}}
      args:
        - --log-level=$(TANDEM_LOG_LEVEL)
        - tp-follower
        - --tp-rendezvous=$(LWS_LEADER_ADDRESS):{{ $tpv.rendezvousPort }}
        - --tensor-parallel-size={{ $layout.size }}
        - --tp-node-index=$(LWS_WORKER_INDEX)
        - --tp-ranks-per-node={{ $layout.gpus }}
        - --tp-join-timeout-s={{ $tpv.joinTimeoutSeconds }}
        - --device=cuda
    {{- else }}
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
        {{- include "tandem.clusterSecretArgs" $root | nindent 8 }}
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
        {{- if gt (int $layout.size) 1 }}
        - --tensor-parallel-size={{ $layout.size }}
        {{- end }}
        {{- if $layout.lws }}
        - --tp-rendezvous=$(LWS_LEADER_ADDRESS):{{ $tpv.rendezvousPort }}
        - --tp-ranks-per-node={{ $layout.gpus }}
        - --tp-join-timeout-s={{ $tpv.joinTimeoutSeconds }}
        {{- end }}
        {{- range $p.extraArgs }}
        - {{ . | quote }}
        {{- end }}
    {{- end }}
      envFrom:
        - configMapRef:
            name: {{ include "tandem.configName" $root }}
      env:
        {{- include "tandem.podEnv" $root | nindent 8 }}
        - name: HOME
          value: /tmp
        {{- with $p.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if not $follower }}
      ports:
        {{- if $layout.lws }}
        - name: tp-rendezvous
          containerPort: {{ $tpv.rendezvousPort }}
          protocol: TCP
        {{- end }}
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
        {{- include "tandem.probeTiming" $w.probes.startup | trim | nindent 8 }}
      readinessProbe:
        grpc:
          port: {{ $w.grpcPort }}
        {{- include "tandem.probeTiming" $w.probes.readiness | trim | nindent 8 }}
      livenessProbe:
        grpc:
          port: {{ $w.grpcPort }}
        {{- include "tandem.probeTiming" $w.probes.liveness | trim | nindent 8 }}
      lifecycle:
        preStop:
          exec:
            command: ["sleep", "{{ $p.preStopSleepSeconds }}"]
      {{- end }}
      {{- $res := deepCopy (default dict $p.resources) }}
      {{- if $p.gpu.enabled }}
      {{- $limits := default dict $res.limits }}
      {{- $_ := set $limits $p.gpu.resourceName (int $layout.gpus) }}
      {{- $_ := set $res "limits" $limits }}
      {{- end }}
      {{- with $res }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
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
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- include "tandem.commonVolumes" $root | nindent 4 }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSizeLimit }}
    {{- with $p.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $p.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $p.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A worker pool whose tensor-parallel group spans nodes: a LeaderWorkerSet
     (leaderworkerset.x-k8s.io/v1) of groups of size/gpusPerNode pods. The leader (LWS
     worker index 0) runs the gRPC worker, rank 0 and its node's ranks; each other pod
     runs `tandem tp-follower` for its node's ranks; all meet at the leader's
     rendezvous port. A pod that restarts recreates its whole group (a group fails as
     one). dict "root" $ "component" ROLE */}}
{{- define "tandem.workerLeaderWorkerSet" -}}
{{- $root := .root -}}
{{- $role := .component -}}
{{- $p := index $root.Values $role -}}
{{- $ctx := dict "root" $root "component" $role -}}
{{- $layout := include "tandem.tpLayout" $ctx | fromYaml -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "tandem.componentName" $ctx }}
  labels:
    {{- include "tandem.componentLabels" $ctx | nindent 4 }}
spec:
  replicas: {{ $p.replicas }}
  startupPolicy: LeaderCreated
  leaderWorkerTemplate:
    size: {{ div (int $layout.size) (int $layout.gpus) }}
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      {{- include "tandem.workerPod" (dict "root" $root "component" $role "follower" false) | nindent 6 }}
    workerTemplate:
      {{- include "tandem.workerPod" (dict "root" $root "component" $role "follower" true) | nindent 6 }}
{{- end -}}

{{/* The pool's workload: a Deployment, or a LeaderWorkerSet where its TP spans nodes. */}}
{{- define "tandem.workerWorkload" -}}
{{- $layout := include "tandem.tpLayout" . | fromYaml -}}
{{- if $layout.lws }}
{{- include "tandem.workerLeaderWorkerSet" . }}
{{- else }}
{{- include "tandem.workerDeployment" . }}
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
    {{- if (include "tandem.tpLayout" . | fromYaml).lws }}
    {{- /* only the leaders serve gRPC; LWS labels them worker-index 0 */}}
    leaderworkerset.sigs.k8s.io/worker-index: "0"
    {{- end }}
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

{{/* The PodDisruptionBudgets of one component. For a pool rendered as a LeaderWorkerSet a
     budget of pods would count a group's pods one by one (one pod of a broken group could
     meet minAvailable 1), so the pool's budget selects the leaders only (LWS labels them
     worker-index "0"; its scale selector counts groups the same way): one per group,
     down whenever its group is, so pdb.* counts groups. A second budget, NAME-workers,
     holds the worker pods (evicting one recreates its group) to the same number of
     groups' worth: an integer times the workers per group, a percentage as given (one
     group's worth where pdb sets neither).
     dict "root" $ "component" NAME */}}
{{- define "tandem.pdb" -}}
{{- $p := index .root.Values .component -}}
{{- if $p.pdb.enabled }}
{{- $lws := and (ne .component "router") (include "tandem.tpLayout" . | fromYaml).lws }}
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
      {{- if $lws }}
      leaderworkerset.sigs.k8s.io/worker-index: "0"
      {{- end }}
{{- if $lws }}
{{- include "tandem.workersPdb" . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A LeaderWorkerSet pool's budget of its worker pods (see tandem.pdb). */}}
{{- define "tandem.workersPdb" -}}
{{- $p := index .root.Values .component -}}
{{- $layout := include "tandem.tpLayout" . | fromYaml -}}
{{- $perGroup := sub (div (int $layout.size) (int $layout.gpus)) 1 -}}
{{- $budget := dict "maxUnavailable" $perGroup -}}
{{- range $k := list "minAvailable" "maxUnavailable" }}
{{- $v := index $p.pdb $k }}
{{- if kindIs "string" $v }}
{{- $_ := set $budget $k $v }}
{{- else if not (kindIs "invalid" $v) }}
{{- $_ := set $budget $k (mul (int $v) $perGroup) }}
{{- end }}
{{- end }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}-workers
  labels:
    {{- include "tandem.componentLabels" . | nindent 4 }}
spec:
  {{- include "tandem.pdbBudget" $budget | trim | nindent 2 }}
  selector:
    matchLabels:
      {{- include "tandem.componentSelectorLabels" . | nindent 6 }}
    matchExpressions:
      - key: leaderworkerset.sigs.k8s.io/worker-index
        operator: NotIn
        values: ["0"]
{{- end -}}
