{{/*
The labels every object carries: the two the plain manifests use (and the DaemonSet selects
on), then Helm's own. The names are fixed (leaseholdd, leaseholdd-config) rather than
prefixed with the release: one agent per node is the design, and a second release in the
namespace fails on the names instead of running two agents on one socket.
*/}}
{{- define "leasehold.selectorLabels" -}}
app.kubernetes.io/name: leasehold
app.kubernetes.io/component: agent
{{- end }}

{{- define "leasehold.labels" -}}
{{ include "leasehold.selectorLabels" . }}
{{ include "leasehold.helmLabels" . }}
{{- end }}

{{/* Helm's own labels, alone on the objects that are not the agent's (the networks). */}}
{{- define "leasehold.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "leasehold.image" -}}
{{- $repo := required "image.repository is required: the image built from deploy/Dockerfile (deploy/README.md, step 1), e.g. --set image.repository=registry.example.com/leasehold/leasehold" .Values.image.repository -}}
{{- printf "%s:%s" $repo (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end }}

{{/* etcd.endpoints as a list; a comma-separated string (--set etcd.endpoints=a,b) is accepted too. */}}
{{- define "leasehold.etcdEndpoints" -}}
{{- $e := .Values.etcd.endpoints -}}
{{- if kindIs "string" $e }}{{ $e = splitList "," $e | compact }}{{ end -}}
{{- if not $e -}}
{{- fail "etcd.endpoints is required: the etcd client URLs, e.g. --set 'etcd.endpoints={https://etcd-1.example.internal:2379,https://etcd-2.example.internal:2379}'" -}}
{{- end -}}
{{- range $e }}
{{- if not (regexMatch "^https?://[^/?#]+/?$" .) }}
{{- fail (printf "etcd.endpoints: %q is not a client URL of the form https://HOST:PORT (or http:// without TLS)" .) }}
{{- end }}
{{- if and $.Values.etcd.tls.enabled (hasPrefix "http://" .) }}
{{- fail (printf "etcd.endpoints: %q is http:// but etcd.tls.enabled is true: use https://, or set etcd.tls.enabled=false for etcd without TLS" .) }}
{{- end }}
{{- end -}}
{{- join "," $e -}}
{{- end }}

{{/* The address --metrics-addr gets; see agent.metricsAddr in values.yaml. */}}
{{- define "leasehold.metricsAddr" -}}
{{- $a := .Values.agent.metricsAddr | default (printf "%s:9615" (ternary "0.0.0.0" "127.0.0.1" .Values.monitoring.enabled)) -}}
{{- if not (regexMatch "^(\\[[0-9A-Fa-f:]+\\]|[0-9.]*):[0-9]{1,5}$" $a) -}}
{{- fail (printf "agent.metricsAddr: %q is not IP:PORT (e.g. 127.0.0.1:9615 or 0.0.0.0:9615; empty for the default)" $a) -}}
{{- end -}}
{{- $host := include "leasehold.metricsHost" $a -}}
{{- $port := regexFind "[0-9]+$" $a | atoi -}}
{{- if or (lt $port 1) (gt $port 65535) -}}
{{- fail (printf "agent.metricsAddr: port %d of %q is not between 1 and 65535" $port $a) -}}
{{- end -}}
{{- $loopback := or (hasPrefix "127." $host) (eq $host "::1") -}}
{{- $any := has $host (list "" "0.0.0.0" "::") -}}
{{- if not (or $loopback $any) -}}
{{- fail (printf "agent.metricsAddr: %q names one node's address, but the setting is the same on every node: use 127.0.0.1:PORT, or 0.0.0.0:PORT to be scraped" $a) -}}
{{- end -}}
{{- if and .Values.monitoring.enabled $loopback -}}
{{- fail (printf "agent.metricsAddr: %q listens on loopback only, so with monitoring.enabled Prometheus could not scrape it: leave it empty (0.0.0.0:9615) or use 0.0.0.0:PORT" $a) -}}
{{- end -}}
{{- $a -}}
{{- end }}

{{/* The host part of an IP:PORT address, without IPv6 brackets. */}}
{{- define "leasehold.metricsHost" -}}
{{- regexReplaceAll ":[0-9]+$" . "" | trimPrefix "[" | trimSuffix "]" -}}
{{- end }}

{{/* The host the probes ask: the loopback address the agent listens on, else 127.0.0.1. */}}
{{- define "leasehold.probeHost" -}}
{{- $host := include "leasehold.metricsHost" (include "leasehold.metricsAddr" .) -}}
{{- if or (hasPrefix "127." $host) (eq $host "::1") }}{{ $host }}{{ else }}127.0.0.1{{ end -}}
{{- end }}

{{- define "leasehold.metricsPort" -}}
{{- regexFind "[0-9]+$" (include "leasehold.metricsAddr" .) -}}
{{- end }}

{{/* The flags the chart sets itself; agent.extraArgs may not repeat them. */}}
{{- define "leasehold.chartFlags" -}}
node cluster node-uid etcd-endpoints etcd-cacert etcd-cert etcd-key etcd-username socket state-dir lease-ttl quarantine gc-grace liveness-interval liveness-grace publish-host-addresses host-netns host-resync spare-leases log-level metrics-addr node-label
{{- end }}

{{/*
agent.nodeLabels as leaseholdd --node-label takes them, KEY=VALUE comma-separated, sorted by
key; empty without any. Keys and values are Kubernetes label keys and values, so none holds
the "=" or "," of the flag's syntax, nor the "$(" the kubelet would expand.
*/}}
{{- define "leasehold.nodeLabels" -}}
{{- $out := list -}}
{{- range $k, $v := .Values.agent.nodeLabels -}}
{{- $v = toString $v -}}
{{- if not (regexMatch "^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" $k) -}}
{{- fail (printf "agent.nodeLabels: key %q is not a Kubernetes label key (such as topology.kubernetes.io/zone or rack)" $k) -}}
{{- end -}}
{{- if not (regexMatch "^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$" $v) -}}
{{- fail (printf "agent.nodeLabels: the value %q of %s is not a Kubernetes label value (letters, digits, - _ . inside)" $v $k) -}}
{{- end -}}
{{- $out = append $out (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $out -}}
{{- end }}

{{- define "leasehold.extraArgs" -}}
{{- $set := splitList " " (include "leasehold.chartFlags" .) -}}
{{- range .Values.agent.extraArgs }}
{{- $a := toString . }}
{{- if not (regexMatch "^--[A-Za-z0-9][A-Za-z0-9-]*=" $a) }}
{{- fail (printf "agent.extraArgs: %q is not of the form --flag=value (a flag and its value as two items would be taken apart; booleans need =true or =false)" $a) }}
{{- end }}
{{- $flag := regexReplaceAll "^--([^=]*)=.*$" $a "${1}" }}
{{- if has $flag $set }}
{{- fail (printf "agent.extraArgs: --%s is set by the chart; set it with its own value (agent.*, etcd.*, cluster) instead of in extraArgs" $flag) }}
{{- end }}
{{- end -}}
{{- end }}

{{/*
A CNI configuration given as a map or a JSON string, as JSON. where names the value for the
error messages. Arguments: (list where config).
*/}}
{{- define "leasehold.cniConfig" -}}
{{- $where := index . 0 -}}
{{- $c := index . 1 -}}
{{- $m := dict -}}
{{- if kindIs "string" $c -}}
{{- $m = fromJson $c -}}
{{- if hasKey $m "Error" -}}
{{- fail (printf "%s.config is not valid JSON: %s" $where (get $m "Error")) -}}
{{- end -}}
{{- else if kindIs "map" $c -}}
{{- $m = $c -}}
{{- else -}}
{{- fail (printf "%s.config must be a map or a JSON string, not %s" $where (kindOf $c)) -}}
{{- end -}}
{{- if not (and $m.cniVersion $m.name) -}}
{{- fail (printf "%s.config has no cniVersion or no name: every CNI configuration needs both" $where) -}}
{{- end -}}
{{- if not (or $m.type $m.plugins) -}}
{{- fail (printf "%s.config has neither type (a single plugin) nor plugins (a list)" $where) -}}
{{- end -}}
{{- if kindIs "string" $c }}{{ $c }}{{ else }}{{ toPrettyJson $m }}{{ end -}}
{{- end }}

{{/* The names of cni.files, space-separated, after checking each entry. */}}
{{- define "leasehold.cniFileNames" -}}
{{- $names := list -}}
{{- range $i, $f := .Values.cni.files }}
{{- $where := printf "cni.files[%d]" $i }}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*\\.(conf|conflist|json)$" (toString $f.name)) }}
{{- fail (printf "%s.name %q is not a file name ending in .conf, .conflist or .json (the runtime reads no other)" $where (toString $f.name)) }}
{{- end }}
{{- if has $f.name $names }}
{{- fail (printf "%s.name %q is given twice" $where $f.name) }}
{{- end }}
{{- $names = append $names $f.name }}
{{- end -}}
{{- join " " $names -}}
{{- end }}

{{/* cluster, checked as leaseholdd checks --cluster (allocator.ValidateName). */}}
{{- define "leasehold.cluster" -}}
{{- $c := required "cluster is required: this cluster's ID, unique among the clusters sharing the etcd and the name its etcd user was made for (leasehold-<cluster>), e.g. --set cluster=cluster-a" .Values.cluster | toString -}}
{{- if or (not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._:@-]*$" $c)) (gt (len $c) 253) -}}
{{- fail (printf "cluster %q: use at most 253 letters, digits and . _ : @ -, starting with a letter or digit" $c) -}}
{{- end -}}
{{- $c -}}
{{- end }}
