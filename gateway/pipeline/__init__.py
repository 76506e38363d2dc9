"""What every API family runs on: body reading, field decoding, translation to the one internal
request, streaming, images and documents. Imports access, models, link, web."""
