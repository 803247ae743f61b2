package index

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestGenerationIndex(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, alias, pv, want string
	}{
		{name: "plain", alias: "records", pv: "v1", want: "records_v1"},
		{name: "dots and dashes kept", alias: "records", pv: "2024.06-2", want: "records_2024.06-2"},
		{name: "upper case", alias: "records", pv: "V2", want: "records_v2-"},
		{name: "invalid characters", alias: "records", pv: "v2/title upper", want: "records_v2-title-upper-"},
		{name: "non-ASCII", alias: "records", pv: "판2", want: "records_-2-"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := GenerationIndex(tt.alias, tt.pv)
			if strings.HasSuffix(tt.want, "-") {
				require.True(t, strings.HasPrefix(got, tt.want), got)
				require.Len(t, got, len(tt.want)+8, "an 8-hex hash of the version follows: %s", got)
			} else {
				require.Equal(t, tt.want, got)
			}
			require.Equal(t, got, GenerationIndex(tt.alias, tt.pv), "deterministic")
			require.Equal(t, strings.ToLower(got), got)
			require.NotContains(t, got, " ")
		})
	}
	require.NotEqual(t, GenerationIndex("records", "V2"), GenerationIndex("records", "v2"), "versions that sanitize alike get different hashes")
	require.NotEqual(t, GenerationIndex("records", "a b"), GenerationIndex("records", "a/b"))
	long := GenerationIndex("records", strings.Repeat("x", 400))
	require.LessOrEqual(t, len(long), maxIndexName)
	require.NotEqual(t, long, GenerationIndex("records", strings.Repeat("x", 401)))
	require.Equal(t, "records_v1-write", GenerationWriteAlias(GenerationIndex("records", "v1")))
}
