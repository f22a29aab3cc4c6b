package conformance

import "github.com/cairn-sandbox/cairn/engine"

func enginepkgOpts(l string) engine.CheckpointOptions { return engine.CheckpointOptions{Label: l} }
