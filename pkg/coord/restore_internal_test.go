package coord

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMarkOrdersFloorBeforeGrants is about logic: a higher floor (a
// promotion, a detected restore) is later whatever the count of grants, and
// within one floor the count only rises.
func TestMarkOrdersFloorBeforeGrants(t *testing.T) {
	t.Parallel()
	require.True(t, mark{floor: 0, grants: 9}.before(mark{floor: 0, grants: 10}))
	require.False(t, mark{floor: 0, grants: 10}.before(mark{floor: 0, grants: 10}))
	require.False(t, mark{floor: 0, grants: 11}.before(mark{floor: 0, grants: 10}))
	require.True(t, mark{floor: 0, grants: 1000}.before(mark{floor: 1 << 32, grants: 3}), "a new timeline restarts nothing")
	require.False(t, mark{floor: 1 << 48, grants: 3}.before(mark{floor: 1 << 32, grants: 1000}))
	require.EqualValues(t, 0, Generation(5<<32))
	require.EqualValues(t, 2, Generation(2<<48+5<<32))
}

// TestEpochMemoryNeverForgets is about logic: the remembered mark and the
// per-lease epochs only rise, whatever order statements return in.
func TestEpochMemoryNeverForgets(t *testing.T) {
	t.Parallel()
	var m epochMemory
	at, seen := m.seen([]string{"a", "b"})
	require.Equal(t, mark{}, at)
	require.Equal(t, []int64{0, 0}, seen)

	m.observe(mark{floor: 0, grants: 7})
	m.observe(mark{floor: 0, grants: 5}) // a statement that started earlier
	m.granted("a", 4)
	m.granted("a", 3)
	m.granted("b", 1)
	at, seen = m.seen([]string{"b", "c", "a"})
	require.Equal(t, mark{floor: 0, grants: 7}, at)
	require.Equal(t, []int64{1, 0, 4}, seen)

	m.observe(mark{floor: 1 << 48, grants: 2}) // after a detected restore
	at, _ = m.seen(nil)
	require.Equal(t, mark{floor: 1 << 48, grants: 2}, at)
}

func TestRegressionSaysWhatWasSeenAndFound(t *testing.T) {
	t.Parallel()
	r := Regression{DetectedBy: "w-a", SeenFloor: 0, SeenGrants: 12, FoundFloor: 0, FoundGrants: 9,
		Leases: []LeaseBehind{{Name: "gateway:g", Seen: 5, Found: 2}}, RaisedTo: 1}
	require.Equal(t, "the database went back in time: w-a saw epoch floor 0 with 12 grants, the database had floor 0 with 9 grants; "+
		"gateway:g was granted at epoch 5, the database had it at 2; generation raised to 1", r.String())
}
