package outbox

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// deadlines records the deadlines set on it.
type deadlines struct {
	net.Conn
	read, write time.Time
}

func (d *deadlines) SetDeadline(t time.Time) error      { d.read, d.write = t, t; return nil }
func (d *deadlines) SetReadDeadline(t time.Time) error  { d.read = t; return nil }
func (d *deadlines) SetWriteDeadline(t time.Time) error { d.write = t; return nil }

// An attempt's deadline gives the connection its cut back for writes, never
// later than the cut, and the full deadline for reads; any other deadline
// (kafka-go's handshake and metadata refresh) applies to both.
func TestCutConnSplitsAttemptDeadlines(t *testing.T) {
	const ackWait = 10 * time.Second
	inner := &deadlines{}
	c := &cutConn{Conn: inner, ackWait: ackWait}
	now := time.Now()
	for i := range 2000 {
		cut := now.Add(time.Duration(i) * 7919 * time.Nanosecond)
		d := attemptDeadline(cut, ackWait)
		require.True(t, isAttemptDeadline(d))
		require.NoError(t, c.SetDeadline(d))
		require.False(t, inner.write.After(cut), "writes after the cut")
		require.Less(t, cut.Sub(inner.write), 2*time.Microsecond, "the cut moved back by more than the mark")
		require.Equal(t, d, inner.read)
		require.Equal(t, ackWait, inner.read.Sub(inner.write))
	}
	// The monotonic reading survives: a deadline compared with a later
	// reading of the clock gives the same answer as the cut itself.
	d := attemptDeadline(now, ackWait)
	require.Equal(t, now.Add(ackWait).Round(0) != now.Add(ackWait), d.Round(0) != d, "monotonic reading kept")

	for _, other := range []time.Time{now.Add(5 * time.Second).Truncate(time.Microsecond), {}} {
		require.NoError(t, c.SetDeadline(other))
		require.Equal(t, other, inner.write)
		require.Equal(t, other, inner.read)
	}
}
