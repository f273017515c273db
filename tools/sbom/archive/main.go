// Command archive writes the CycloneDX SBOM of a release archive or package
// (a .tar.gz, .deb or .rpm) from the SBOMs cyclonedx-gomod wrote of the
// binaries it holds: the artifact is the BOM's subject (a "file" component
// with its SHA-256), each binary an "application" component it depends on,
// and their modules the union of the binaries' components and dependency
// graphs. deploy/release/release.sh runs it:
//
//	GOWORK=off go -C tools/sbom run ./archive -artifact PATH -version V -out OUT BINARY.cdx.json...
package main

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	cdx "github.com/CycloneDX/cyclonedx-go"
)

func main() {
	artifact := flag.String("artifact", "", "the archive or package the SBOM describes")
	version := flag.String("version", "", "the release version")
	out := flag.String("out", "", "where to write the SBOM (JSON)")
	flag.Parse()
	if *artifact == "" || *version == "" || *out == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: archive -artifact PATH -version V -out OUT BINARY.cdx.json...")
		os.Exit(2)
	}
	if err := run(*artifact, *version, *out, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "sbom archive:", err)
		os.Exit(1)
	}
}

func run(artifact, version, out string, inputs []string) error {
	sum, err := sha256File(artifact)
	if err != nil {
		return err
	}
	name := filepath.Base(artifact)
	subject := cdx.Component{
		BOMRef:  "file:" + name,
		Type:    cdx.ComponentTypeFile,
		Name:    name,
		Version: version,
		Hashes:  &[]cdx.Hash{{Algorithm: cdx.HashAlgoSHA256, Value: sum}},
	}
	serial, err := uuid()
	if err != nil {
		return err
	}
	bom := cdx.NewBOM()
	bom.SerialNumber = "urn:uuid:" + serial
	bom.Metadata = &cdx.Metadata{Timestamp: time.Now().UTC().Format(time.RFC3339), Component: &subject}

	var components []cdx.Component
	seen := map[string]bool{}
	deps := map[string][]string{}
	var order, apps []string
	add := func(c cdx.Component) {
		if c.BOMRef == "" || !seen[c.BOMRef] {
			seen[c.BOMRef] = true
			components = append(components, c)
		}
	}
	for _, in := range inputs {
		b, err := decode(in)
		if err != nil {
			return err
		}
		if b.Metadata == nil || b.Metadata.Component == nil {
			return fmt.Errorf("%s: no metadata.component", in)
		}
		if bom.Metadata.Tools == nil {
			bom.Metadata.Tools = b.Metadata.Tools
		}
		app := *b.Metadata.Component
		apps = append(apps, app.BOMRef)
		add(app)
		if b.Components != nil {
			for _, c := range *b.Components {
				add(c)
			}
		}
		if b.Dependencies != nil {
			for _, d := range *b.Dependencies {
				if _, ok := deps[d.Ref]; !ok {
					order = append(order, d.Ref)
				}
				if d.Dependencies != nil {
					for _, on := range *d.Dependencies {
						if !slices.Contains(deps[d.Ref], on) {
							deps[d.Ref] = append(deps[d.Ref], on)
						}
					}
				} else if deps[d.Ref] == nil {
					deps[d.Ref] = []string{}
				}
			}
		}
	}
	dependencies := []cdx.Dependency{{Ref: subject.BOMRef, Dependencies: &apps}}
	for _, ref := range order {
		on := deps[ref]
		dependencies = append(dependencies, cdx.Dependency{Ref: ref, Dependencies: &on})
	}
	bom.Components = &components
	bom.Dependencies = &dependencies

	f, err := os.Create(out)
	if err != nil {
		return err
	}
	enc := cdx.NewBOMEncoder(f, cdx.BOMFileFormatJSON).SetPretty(true)
	if err := enc.EncodeVersion(bom, cdx.SpecVersion1_6); err != nil {
		_ = f.Close()
		return fmt.Errorf("%s: %w", out, err)
	}
	return f.Close()
}

func decode(path string) (*cdx.BOM, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var b cdx.BOM
	if err := cdx.NewBOMDecoder(f, cdx.BOMFileFormatJSON).Decode(&b); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &b, nil
}

func sha256File(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// uuid returns a random (version 4) UUID for the BOM's serial number.
func uuid() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}
