{{- define "gpushare.labels" -}}
app.kubernetes.io/name: jupyter-gpushare
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
