#!/bin/bash
cat > /app/scene.json <<'JSON'
{
  "objects": [
    {"name": "table", "type": "box", "size": [2, 1, 0.8], "position": [5, 5, 0.4]},
    {"name": "chair", "type": "box", "size": [0.5, 0.5, 1.0], "position": [5, 6.0, 0.5]},
    {"name": "lamp", "type": "box", "size": [0.3, 0.3, 1.6], "position": [8, 8, 0.8]}
  ],
  "camera": {"position": [1, 1, 1.7], "look_at": [5, 5, 0.4]},
  "lights": [{"type": "point", "position": [5, 5, 3], "intensity": 800}]
}
JSON
