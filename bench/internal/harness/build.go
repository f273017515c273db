package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
)

// RepoRoot is the repository's root directory (benches run from source).
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// Binaries builds each named service (gateway, worker, …) into dir and
// returns service -> path. When binDir is set and holds
// leasehold-<service>, that prebuilt binary is used instead.
func Binaries(dir, binDir string, services ...string) (map[string]string, error) {
	out := map[string]string{}
	for _, s := range services {
		if binDir != "" {
			p := filepath.Join(binDir, "leasehold-"+s)
			if _, err := os.Stat(p); err == nil {
				out[s] = p
				continue
			}
		}
		p := filepath.Join(dir, "leasehold-"+s)
		if err := GoBuild(filepath.Join(RepoRoot(), "services", s), p); err != nil {
			return nil, err
		}
		out[s] = p
	}
	return out, nil
}

// GoBuild runs `go build -o out .` in pkgDir.
func GoBuild(pkgDir, out string) error {
	cmd := exec.Command("go", "build", "-o", out, ".")
	cmd.Dir = pkgDir
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", pkgDir, err, b)
	}
	return nil
}
