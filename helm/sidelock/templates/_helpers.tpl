{{/*
Names and labels.

Every helper in this chart takes a context dict {"root": <top-level context>,
"values": <sidelock values>} built by "sidelock.context" (see _sidecar.tpl),
so that the same helpers give the same names when they run inside this chart
and when an application chart that depends on it includes them.
*/}}

{{/*
Chart name. The chart's own name is fixed ("sidelock"), so the helper does not
depend on .Chart, which is the application chart's when called from there.
*/}}
{{- define "sidelock.name" -}}
{{- default "sidelock" .values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified name: "<release>-sidelock", truncated to 63 characters (DNS
label limit), or the release name alone when it already contains the name.
*/}}
{{- define "sidelock.fullname" -}}
{{- if .values.fullnameOverride -}}
{{- .values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "sidelock.name" . -}}
{{- if contains $name .root.Release.Name -}}
{{- .root.Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .root.Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Chart label value: sidelock-<chart version>. Only meaningful inside this chart.
*/}}
{{- define "sidelock.chart" -}}
{{- printf "sidelock-%s" (.root.Chart.Version | replace "+" "_") | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels of this chart's resources.
*/}}
{{- define "sidelock.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sidelock.name" . }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{/*
Common labels of this chart's resources.
*/}}
{{- define "sidelock.labels" -}}
helm.sh/chart: {{ include "sidelock.chart" . }}
{{ include "sidelock.selectorLabels" . }}
app.kubernetes.io/version: {{ include "sidelock.imageTag" . | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: sidelock
{{- with .values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Label that marks a pod as carrying this release's sidecar; the metrics Service
selects on it.
*/}}
{{- define "sidelock.instanceLabel" -}}
sidelock/instance: {{ include "sidelock.fullname" . }}
{{- end -}}

{{/*
Image tag and full image reference (by digest when image.digest is set).
*/}}
{{- define "sidelock.imageTag" -}}
{{- .values.image.tag -}}
{{- end -}}

{{- define "sidelock.image" -}}
{{- if .values.image.digest -}}
{{- printf "%s@%s" .values.image.repository .values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .values.image.repository (include "sidelock.imageTag" .) -}}
{{- end -}}
{{- end -}}

{{/*
Resource names.
*/}}
{{- define "sidelock.configMapName" -}}
{{- include "sidelock.fullname" . -}}
{{- end -}}

{{- define "sidelock.secretName" -}}
{{- .values.auth.existingSecret | default (include "sidelock.fullname" .) -}}
{{- end -}}

{{- define "sidelock.metricsServiceName" -}}
{{- printf "%s-metrics" (include "sidelock.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{/*
A duration value ("250ms", "30s", "1m30s", or an integer of milliseconds) as
a string sidelock parses: integers become "<n>ms".
*/}}
{{- define "sidelock.duration" -}}
{{- if kindIs "string" . -}}
{{- . -}}
{{- else -}}
{{- printf "%dms" (int64 .) -}}
{{- end -}}
{{- end -}}

{{/*
A duration value in milliseconds, and in whole seconds rounded up.
*/}}
{{- define "sidelock.durationMs" -}}
{{- $ms := 0 -}}
{{- if kindIs "string" . -}}
{{- if regexMatch "^[0-9]+$" . -}}
{{- $ms = atoi . -}}
{{- else -}}
{{- range regexFindAll "[0-9]+(ms|s|m|h)" . -1 -}}
{{- $n := regexFind "^[0-9]+" . | atoi -}}
{{- $unit := trimPrefix (regexFind "^[0-9]+" .) . -}}
{{- $factor := get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit -}}
{{- $ms = add $ms (mul $n $factor) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $ms = int64 . -}}
{{- end -}}
{{- $ms -}}
{{- end -}}

{{- define "sidelock.durationSeconds" -}}
{{- div (add (include "sidelock.durationMs" . | int64) 999) 1000 -}}
{{- end -}}
