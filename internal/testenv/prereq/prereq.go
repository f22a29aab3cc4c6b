// Package prereq is how cairn's tests say what they need: outside CI a missing
// prerequisite skips the test, with the reason; with CI=true it fails it, so CI never
// passes by skipping. It imports nothing of cairn's, for the packages below the engine
// (internal/testenv, which builds a whole engine, uses it too).
package prereq

import (
	"os"
	"testing"
)

// Missing skips tb (outside CI) or fails it (in CI) for the prerequisite why.
func Missing(tb testing.TB, why string) {
	tb.Helper()
	if os.Getenv("CI") == "true" {
		tb.Fatalf("prerequisite missing in CI: %s", why)
	}
	tb.Skipf("skipping: %s", why)
}

// Root is Missing(tb, why) unless the test runs as root; why says what needs root.
func Root(tb testing.TB, why string) {
	tb.Helper()
	if os.Geteuid() != 0 {
		Missing(tb, why)
	}
}
