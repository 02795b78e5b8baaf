package lease

import "testing"

// TestAttrsAllocateNothing: the attribute set of a measurement is built once per
// combination; every later lookup allocates nothing, whether or not an SDK is
// installed.
func TestAttrsAllocateNothing(t *testing.T) {
	label.attrs(AttrOperation, "acquire", AttrResult, "acquired")
	if n := testing.AllocsPerRun(100, func() {
		label.attrs(AttrOperation, "acquire", AttrResult, "acquired")
		label.attrs()
	}); n != 0 {
		t.Errorf("%v allocations per lookup of cached attribute sets, want 0", n)
	}
}
