package batch

import _ "embed"

// DemoSchemaSQL creates the demo source table source_records (id,
// created_at, tenant_id, version, change_seq, deleted_at, payload jsonb) with
// its indexes and the trigger that bumps version and change_seq on update.
// It is the user's table, not a migration: the demo, the end-to-end tests
// and this package's tests run it. Idempotent.
//
//go:embed demo_schema.sql
var DemoSchemaSQL string

// DemoSpec returns a spec for source_records: cursor (created_at, id),
// version, soft delete by deleted_at, the document built from payload's
// title, body and tags, and the quarantine policy.
func DemoSpec() Spec {
	return Spec{
		Job: "records",
		Source: Source{
			Table:   "source_records",
			Cursor:  []string{"created_at", "id"},
			ID:      "id",
			Version: "version",
			Deleted: "deleted_at",
		},
		Document: Document{
			Fields: []Field{
				{Name: "id", From: "id"},
				{Name: "tenant", From: "tenant_id"},
				{Name: "title", From: "payload.title", Transforms: []string{"trim"}, Type: "string", Required: true},
				{Name: "body", From: "payload.body", Type: "string"},
				{Name: "tags", From: "payload.tags", Type: "array"},
				{Name: "created_at", From: "created_at"},
			},
			DropNulls: true,
		},
		ProcessorVersion: "v1",
		Errors:           ErrorPolicy{Policy: PolicyQuarantine},
	}
}
