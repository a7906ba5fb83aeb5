package integration

import (
	"fmt"
	"path"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// deployEnv is a container's environment as the kubelet builds it, for $(VAR) expansion.
type deployEnv struct {
	vals   map[string]string
	source map[string]string // "configmap", "fieldRef:<path>", "secret", "value", ...
}

func (d *deployment) configMap(ns, name string) *corev1.ConfigMap {
	for i := range d.ConfigMaps {
		if d.ConfigMaps[i].Namespace == ns && d.ConfigMaps[i].Name == name {
			return &d.ConfigMaps[i]
		}
	}
	return nil
}

func (d *deployment) secret(ns, name string) *corev1.Secret {
	for i := range d.Secrets {
		if d.Secrets[i].Namespace == ns && d.Secrets[i].Name == name {
			return &d.Secrets[i]
		}
	}
	return nil
}

func deploySecretHasKey(s *corev1.Secret, key string) bool {
	_, a := s.StringData[key]
	_, b := s.Data[key]
	return a || b
}

func (d *deployment) containerEnv(ns string, c *corev1.Container) (deployEnv, []string) {
	var probs []string
	env := deployEnv{vals: map[string]string{}, source: map[string]string{}}
	for _, ef := range c.EnvFrom {
		switch {
		case ef.ConfigMapRef != nil:
			cm := d.configMap(ns, ef.ConfigMapRef.Name)
			if cm == nil {
				if ef.ConfigMapRef.Optional == nil || !*ef.ConfigMapRef.Optional {
					probs = append(probs, fmt.Sprintf("container %s: envFrom ConfigMap %s/%s is not among the manifests", c.Name, ns, ef.ConfigMapRef.Name))
				}
				continue
			}
			for k, v := range cm.Data {
				env.vals[ef.Prefix+k], env.source[ef.Prefix+k] = v, "configmap:"+cm.Name
			}
		case ef.SecretRef != nil:
			probs = append(probs, fmt.Sprintf("container %s: envFrom a Secret puts every key into the environment; reference the keys one by one", c.Name))
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env.vals[e.Name], env.source[e.Name] = e.Value, "value"
		case e.ValueFrom.FieldRef != nil:
			env.vals[e.Name], env.source[e.Name] = "value-of-"+e.ValueFrom.FieldRef.FieldPath, "fieldRef:"+e.ValueFrom.FieldRef.FieldPath
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm := d.configMap(ns, ref.Name)
			v, ok := "", false
			if cm != nil {
				v, ok = cm.Data[ref.Key]
			}
			if !ok && (ref.Optional == nil || !*ref.Optional) {
				probs = append(probs, fmt.Sprintf("container %s: env %s refers to ConfigMap %s/%s key %q, which does not exist", c.Name, e.Name, ns, ref.Name, ref.Key))
			}
			env.vals[e.Name], env.source[e.Name] = v, "configmap:"+ref.Name
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			// Optional or not, the Secret template documents every key the agent can use.
			if s := d.secret(ns, ref.Name); s == nil || !deploySecretHasKey(s, ref.Key) {
				probs = append(probs, fmt.Sprintf("container %s: env %s refers to Secret %s/%s key %q, which the Secret template does not have", c.Name, e.Name, ns, ref.Name, ref.Key))
			}
			env.vals[e.Name], env.source[e.Name] = "secret-value", "secret:"+ref.Name
		default:
			env.vals[e.Name], env.source[e.Name] = "other-value", "other"
		}
	}
	return env, probs
}

// expand replaces $(VAR) as the kubelet does; an undefined VAR is a problem (the kubelet
// would pass the text through unchanged).
func (env deployEnv) expand(where, s string) (string, []string) {
	var probs []string
	out := deployVarRef.ReplaceAllStringFunc(s, func(m string) string {
		name := m[2 : len(m)-1]
		v, ok := env.vals[name]
		if !ok {
			probs = append(probs, fmt.Sprintf("%s: %q refers to $(%s), which no env or envFrom defines (the agent would get the text %q)", where, s, name, m))
			return m
		}
		return v
	})
	return out, probs
}

// deployMountFor returns the volume mount of c that holds containerPath (the longest one) and
// its volume.
func deployMountFor(spec *corev1.PodSpec, c *corev1.Container, containerPath string) (*corev1.VolumeMount, *corev1.Volume, string) {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		m := &c.VolumeMounts[i]
		mp := path.Clean(m.MountPath)
		if (containerPath == mp || strings.HasPrefix(containerPath, mp+"/")) && (best == nil || len(mp) > len(path.Clean(best.MountPath))) {
			best = m
		}
	}
	if best == nil {
		return nil, nil, ""
	}
	rel := strings.TrimPrefix(containerPath, path.Clean(best.MountPath))
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == best.Name {
			return best, &spec.Volumes[i], rel
		}
	}
	return best, nil, rel
}

// deployHostPathOf maps a path in container c to the host path behind it, if a hostPath volume
// holds it.
func deployHostPathOf(spec *corev1.PodSpec, c *corev1.Container, containerPath string) (string, bool) {
	_, vol, rel := deployMountFor(spec, c, containerPath)
	if vol == nil || vol.HostPath == nil {
		return "", false
	}
	return path.Clean(vol.HostPath.Path) + rel, true
}

func deployHasCap(caps *corev1.Capabilities, want string) bool {
	if caps == nil {
		return false
	}
	for _, c := range caps.Add {
		if strings.TrimPrefix(strings.ToUpper(string(c)), "CAP_") == want {
			return true
		}
	}
	return false
}
