package wire

import "testing"

func TestCapacityTotal(t *testing.T) {
	for _, tc := range []struct {
		c    Capacity
		want uint64
	}{
		{Capacity{}, 0},
		{Capacity{L1Bytes: 1 << 30}, 1 << 30},
		{Capacity{L1Bytes: 1, L2Bytes: 2, L3Bytes: 3}, 6},
		{Capacity{L1Bytes: 1 << 30, L3Bytes: CapacityUnbounded}, CapacityUnbounded},
		{Capacity{L1Bytes: CapacityUnbounded - 1, L2Bytes: 1}, CapacityUnbounded},
		{Capacity{L1Bytes: CapacityUnbounded - 1, L2Bytes: 2}, CapacityUnbounded},
		{Capacity{L2Bytes: CapacityUnbounded, L3Bytes: CapacityUnbounded}, CapacityUnbounded},
	} {
		if got := tc.c.Total(); got != tc.want {
			t.Errorf("%+v.Total() = %d, want %d", tc.c, got, tc.want)
		}
	}
}
