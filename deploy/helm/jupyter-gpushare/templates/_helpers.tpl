{{/* Namespace of every namespaced object (kernel pods, Secrets, Leases, GpuLedgers too). */}}
{{- define "gpushare.namespace" -}}
{{- .Values.namespace | default .Release.Namespace -}}
{{- end -}}

{{/*
Prefix of cluster-wide names (ClusterRoles and their bindings): none in the namespace "gpushare"
(the names of deploy/rbac.yaml), "<namespace>-" elsewhere, so that installs in two namespaces
never share or overwrite each other's cluster-wide objects.
*/}}
{{- define "gpushare.clusterPrefix" -}}
{{- $ns := include "gpushare.namespace" . -}}
{{- if ne $ns "gpushare" -}}{{ $ns }}-{{- end -}}
{{- end -}}

{{- define "gpushare.labels" -}}
app.kubernetes.io/name: jupyter-gpushare
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpushare.daemonSelector" -}}
app.kubernetes.io/name: jupyter-gpushare
app.kubernetes.io/component: node-daemon
{{- end -}}

{{- define "gpushare.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
