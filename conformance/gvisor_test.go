package conformance

import "testing"

// TestGVisor runs the suite on the gVisor backend (runsc, systrap platform).
func TestGVisor(t *testing.T) {
	Run(t, harness(t, "gvisor"))
}
