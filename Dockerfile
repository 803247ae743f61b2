# One image with the three outboxrelay binaries:
#   docker build -t outboxrelay .
#   docker run --rm outboxrelay batcher --help
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/ ./cmd/batcher ./cmd/publisher ./cmd/indexer

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/batcher /out/publisher /out/indexer /usr/local/bin/
COPY demo/job.yaml /etc/outboxrelay/job.yaml
USER nonroot
# Each service names its binary as the command (see docker-compose.yml).
ENTRYPOINT []
CMD ["batcher", "--help"]
