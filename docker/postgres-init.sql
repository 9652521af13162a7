-- One Postgres for both servers: MLflow's database is created by the image, Prefect's here.
CREATE DATABASE prefect;
