// Package shutdown turns SIGINT/SIGTERM into context cancellation in two
// steps: the first signal asks for a soft stop (finish or roll back the unit
// of work in flight, then exit at the last committed point), a second signal
// or the grace period expiring forces a hard stop.
package shutdown

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// Contexts returns soft and hard. soft is cancelled on the first SIGINT or
// SIGTERM; hard is cancelled on the second signal, or grace after the first
// (grace <= 0 means only a second signal). Use soft to decide whether to start
// the next unit of work and hard for the queries of the unit in flight.
func Contexts(parent context.Context, grace time.Duration, logger *slog.Logger) (soft, hard context.Context, stop func()) {
	hard, cancelHard := context.WithCancel(parent)
	soft, cancelSoft := context.WithCancel(hard)
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-ch:
			logger.Info("stopping softly; send the signal again to stop at once", slog.String("signal", sig.String()), slog.Duration("grace", grace))
			cancelSoft()
		case <-done:
			return
		}
		var timer <-chan time.Time
		if grace > 0 {
			timer = time.After(grace)
		}
		select {
		case sig := <-ch:
			logger.Warn("hard stop: cancelling work in flight", slog.String("signal", sig.String()))
		case <-timer:
			logger.Warn("hard stop: grace period expired", slog.Duration("grace", grace))
		case <-done:
		}
		cancelHard()
	}()
	return soft, hard, func() {
		signal.Stop(ch)
		close(done)
		cancelSoft()
		cancelHard()
	}
}
