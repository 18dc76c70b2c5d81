"""The worker's data planes: frames (protos/frames.py) over TCP and shared memory, and the frame
handler they share with the gRPC frame stream."""
