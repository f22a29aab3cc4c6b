package gvisor

import (
	"encoding/json"
	"os"
	"path/filepath"

	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
)

// The subset of the OCI runtime spec (config.json) cairn writes; runsc reads the rest
// as defaults. Kept local: the full runtime-spec module would be a dependency for five
// structs.
type ociSpec struct {
	Version  string     `json:"ociVersion"`
	Process  ociProcess `json:"process"`
	Root     ociRoot    `json:"root"`
	Hostname string     `json:"hostname"`
	Mounts   []ociMount `json:"mounts"`
	Linux    ociLinux   `json:"linux"`
}

type ociProcess struct {
	User         struct{ UID, GID uint32 } `json:"user"`
	Args         []string                  `json:"args"`
	Env          []string                  `json:"env"`
	Cwd          string                    `json:"cwd"`
	Capabilities map[string][]string       `json:"capabilities"`
	Rlimits      []ociRlimit               `json:"rlimits"`
}

type ociRlimit struct {
	Type string `json:"type"`
	Hard uint64 `json:"hard"`
	Soft uint64 `json:"soft"`
}

type ociRoot struct {
	Path     string `json:"path"`
	Readonly bool   `json:"readonly"`
}

type ociMount struct {
	Destination string   `json:"destination"`
	Type        string   `json:"type"`
	Source      string   `json:"source"`
	Options     []string `json:"options,omitempty"`
}

type ociLinux struct {
	Namespaces  []ociNamespace `json:"namespaces"`
	CgroupsPath string         `json:"cgroupsPath,omitempty"`
	Resources   *ociResources  `json:"resources,omitempty"`
}

type ociNamespace struct {
	Type string `json:"type"`
}

type ociResources struct {
	Memory *struct {
		Limit int64 `json:"limit"`
	} `json:"memory,omitempty"`
	Pids *struct {
		Limit int64 `json:"limit"`
	} `json:"pids,omitempty"`
	CPU *struct {
		Quota  int64  `json:"quota"`
		Period uint64 `json:"period"`
	} `json:"cpu,omitempty"`
}

// caps is the capability set of the sandbox's processes inside gVisor: the container
// backend's (Docker's default less NET_RAW). They are capabilities of gVisor's kernel,
// not of the host: the sentry itself runs with its own reduced host set.
var caps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
	"CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// spec is the OCI config of one run of a sandbox. Restore must be given the same mounts
// as the run its image was taken from; only the sources may move (a fork's new root).
//
// /tmp is bound from the root explicitly: runsc otherwise mounts a tmpfs there, whose
// files would live in the memory image, out of reach of cairn's file operations and of
// the filesystem half of checkpoints.
func spec(sb *isolation.Sandbox, cid string) *ociSpec {
	all := map[string][]string{}
	for _, k := range []string{"bounding", "effective", "inheritable", "permitted"} {
		all[k] = caps
	}
	s := &ociSpec{
		Version: "1.0.2",
		Process: ociProcess{
			Args:         []string{"/" + filepath.Join(initctl.Dir, initctl.InitBin), "boot"},
			Env:          []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "GOMAXPROCS=1", "GOGC=50"},
			Cwd:          "/",
			Capabilities: all,
			Rlimits:      []ociRlimit{{Type: "RLIMIT_NOFILE", Hard: 1 << 20, Soft: 1 << 20}},
		},
		Root:     ociRoot{Path: sb.Root},
		Hostname: sb.Hostname,
		Mounts: []ociMount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts"},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm"},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/tmp", Type: "bind", Source: filepath.Join(sb.Root, "tmp"), Options: []string{"rbind", "rw"}},
		},
		Linux: ociLinux{CgroupsPath: cgroupParent + "/" + cid, Resources: resources(sb.Limits)},
	}
	for _, ns := range []string{"pid", "network", "ipc", "uts", "mount"} {
		s.Linux.Namespaces = append(s.Linux.Namespaces, ociNamespace{Type: ns})
	}
	return s
}

// cgroupParent holds the host cgroups runsc makes for each sandbox's sentry and gofer.
const cgroupParent = "/cairn-gvisor"

// resources turns cairn's limits into the sandbox cgroup's, with the container
// backend's defaults.
func resources(l isolation.Limits) *ociResources {
	r := &ociResources{}
	mem := l.MemoryBytes
	if mem <= 0 {
		mem = isolation.DefaultMemoryBytes
	}
	pids := l.Pids
	if pids <= 0 {
		pids = 1024
	}
	cpus := l.CPUs
	if cpus <= 0 {
		cpus = 2
	}
	r.Memory = &struct {
		Limit int64 `json:"limit"`
	}{mem}
	r.Pids = &struct {
		Limit int64 `json:"limit"`
	}{pids}
	r.CPU = &struct {
		Quota  int64  `json:"quota"`
		Period uint64 `json:"period"`
	}{int64(cpus * 100000), 100000}
	return r
}

// writeBundle writes the OCI bundle (config.json) of one run into dir.
func writeBundle(dir string, s *ociSpec) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600)
}
