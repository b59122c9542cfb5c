{{/* Names and labels shared by the templates. */}}
{{- define "kvtier.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.coordinator" -}}{{ include "kvtier.fullname" . }}-coordinator{{- end -}}
{{- define "kvtier.headless" -}}{{ include "kvtier.fullname" . }}-coordinator-headless{{- end -}}

{{- define "kvtier.labels" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvtier.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}

{{/* Pod DNS name of coordinator i: <sts>-<i>.<headless>.<namespace>.svc */}}
{{- define "kvtier.coordHost" -}}
{{- printf "%s-%d.%s.%s.svc" (include "kvtier.coordinator" .root) .i (include "kvtier.headless" .root) .root.Release.Namespace -}}
{{- end -}}

{{/* The coordinators' gossip addresses, the seeds every daemon joins. */}}
{{- define "kvtier.join" -}}
{{- $out := list -}}
{{- range $i := until (int .Values.coordinator.replicas) -}}
{{- $out = append $out (printf "%s:7946" (include "kvtier.coordHost" (dict "root" $ "i" $i))) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* The NATS URLs of the coordinators' embedded servers. */}}
{{- define "kvtier.nats" -}}
{{- $out := list -}}
{{- range $i := until (int .Values.coordinator.replicas) -}}
{{- $out = append $out (printf "nats://%s:4222" (include "kvtier.coordHost" (dict "root" $ "i" $i))) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* An init container copying a Secret (mounted at /secret) into the
memory volume "creds" as regular 0600 files of the daemon's user. */}}
{{- define "kvtier.credsInit" -}}
- name: creds
  image: "{{ .Values.initImage.repository }}:{{ .Values.initImage.tag }}"
  command: ["sh", "-c", "cp -L /secret/* /creds/ && chmod 0600 /creds/* && chmod 0644 /creds/users.json /creds/ca.pem"]
  securityContext:
    runAsUser: {{ .Values.runAsUser }}
    runAsNonRoot: true
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - {name: creds-secret, mountPath: /secret, readOnly: true}
    - {name: creds, mountPath: /creds}
{{- end -}}
